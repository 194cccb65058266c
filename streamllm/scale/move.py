"""Moving a session between replicas (draining one): snapshot on the source, restore on the target.

    refuse new writes for the session (`unavailable` meanwhile) and wait for those in flight
    source: stop its feeds, let pending data in, snapshot       -> LOG_DIR/moves/<name>-<ns>.safetensors
    target: restore (validated), logged in its own ingest log  -> its feeds restart with the session
    placement.json updated                                     <- the move commits here
    source: close its copy, restart its other feeds

A front door that dies between the restore and the close leaves the session on both replicas;
the next one keeps the copy placement.json names and closes the other (placement.reconcile).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from streamllm.scale.errors import ReplicaUnavailable
from streamllm.scale.handle import ReplicaState

if TYPE_CHECKING:
    from streamllm.scale.cluster import ClusterEngine


def move_session(cluster: ClusterEngine, name: str, to: int) -> dict[str, Any]:
    """Snapshot `name` on its replica, restore it on replica `to`, update the placement, close the source copy."""
    if not isinstance(to, int) or not 0 <= to < len(cluster.replicas):
        raise ValueError(f"move {name!r}: replica must be 0..{len(cluster.replicas) - 1}, got {to!r}")
    t0 = time.perf_counter()
    with cluster._place_lock:
        src = cluster.replica_of(name)
        if src.index == to:
            raise ValueError(f"move {name!r}: it is already on replica {to}")
        dst = cluster.replicas[to]
        if dst.state != ReplicaState.UP:
            raise ReplicaUnavailable(f"move {name!r}: replica {to} is not up", replica=to)
        cluster._moving.add(name)
        try:
            with cluster._writes_cond:  # pushes already routed to the source land before the snapshot
                if not cluster._writes_cond.wait_for(lambda: not cluster._writes.get(name), cluster.call_timeout_s):
                    raise ReplicaUnavailable(f"move {name!r}: writes in flight did not finish; nothing moved")
            path = cluster.log_dir / "moves" / f"{quote(name, safe='')}-{time.time_ns()}.safetensors"
            snap, positions = cluster._call(src, "snapshot_for_move", name, str(path), timeout=300)
            try:
                cluster._call(dst, "restore_session", str(path), name, positions, timeout=300)
            except BaseException:
                with contextlib.suppress(Exception):
                    cluster._call(src, "start_feeds")
                raise
            cluster.placement.place(name, to)  # the move commits here
            cluster._call(src, "finish_move_out", name, timeout=300)
        finally:
            cluster._moving.discard(name)
    return {"session": name, "from": src.index, "to": to, "data_version": snap.data_version,
            "snapshot": str(path), "seconds": round(time.perf_counter() - t0, 3)}
