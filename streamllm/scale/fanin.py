"""Subscriptions fan in: one event pump per replica feeds the front door's local hub.

    Replica.events(after, timeout)  --long-poll-->  EventPump (a thread per replica)
        --> FanInHub.publish(session, kind, ...)  --> the service's callbacks (ws, SSE), in order

Each session lives on one replica and each replica's journal is in publication order,
so one pump per replica keeps every session's events in order. The pump is also the
front door's failure detector: its poll is always in flight, so a dead replica is seen
at once (the replica is marked down and its sessions' calls fail fast with
`unavailable`). It then waits for the restarted actor (whose constructor recovered its
sessions), marks it up, and resynchronizes subscribers: the new incarnation's journal
from the start, then each subscribed session's current standing answers and data
version (the service drops repeats of what a subscriber already has).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from streamllm.engine.subscriptions import SubscriptionHub
from streamllm.scale.handle import ReplicaState

if TYPE_CHECKING:
    from streamllm.scale.cluster import ClusterEngine
    from streamllm.scale.handle import ReplicaHandle

log = logging.getLogger("streamllm.scale.fanin")


class FanInHub(SubscriptionHub):
    def sessions(self) -> set[str]:
        with self._lock:
            return {session for (session, _), subs in self._subs.items() if subs}


class EventPump:
    def __init__(self, cluster: ClusterEngine, handle: ReplicaHandle, poll_s: float = 1.0) -> None:
        self.cluster, self.handle, self.poll_s = cluster, handle, poll_s
        self.delivered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"streamllm-pump-{handle.index}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        after = 0
        while not self._stop.is_set():
            h = self.handle
            if h.state != ReplicaState.UP:
                if not self._await_ready():
                    return
                after = self._resync()
                continue
            try:
                batch = ray.get(h.actor.events.remote(after, self.poll_s), timeout=self.poll_s + self.cluster.call_timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                self.cluster.mark_down(h, exc)
                continue
            except Exception as exc:  # the pump never dies: log, back off, poll again
                log.exception("replica %d: event poll failed: %r", h.index, exc)
                time.sleep(self.poll_s)
                continue
            if batch.incarnation != h.incarnation:  # restarted between two polls
                self.cluster.mark_down(h, "restarted (new incarnation)")
                continue
            if batch.gap:
                log.warning("replica %d: the event journal dropped events before this poll; resynchronizing", h.index)
            self._deliver(batch.events)
            after = batch.next_seq
            if batch.gap:
                after = self._resync(after)

    def _deliver(self, events: Any) -> None:
        hub = self.cluster.hub
        for ev in events:
            hub.publish(ev.session, ev.kind, *ev.args)
            self.delivered += 1

    def _await_ready(self) -> bool:
        """Wait for the (restarted) actor to answer `ready` (its constructor recovered its sessions)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        ref = None
        while not self._stop.is_set():
            ref = ref or self.handle.actor.ready.remote()
            try:
                info = ray.get(ref, timeout=self.poll_s)
            except GetTimeoutError:
                continue
            except RayActorError:
                ref = None
                time.sleep(0.1)
                continue
            self.cluster.mark_up(self.handle, info)
            return True
        return False

    def _resync(self, after: int = 0) -> int:
        """After a restart (or a gap): the journal since `after`, then the current state of subscribed sessions."""
        import ray

        h = self.handle
        try:
            batch = ray.get(h.actor.events.remote(after, 0.0), timeout=self.cluster.call_timeout_s)
            self._deliver(batch.events)
            hub = self.cluster.hub
            for name in sorted(hub.sessions()):
                if self.cluster.placement.get(name) != h.index:
                    continue
                try:
                    info = ray.get(h.actor.session_info.remote(name), timeout=self.cluster.call_timeout_s)
                    standing = ray.get(h.actor.standing.remote(name), timeout=self.cluster.call_timeout_s)
                except ray.exceptions.RayTaskError as exc:  # not recovered (a hole in its log): nothing to say
                    log.warning("replica %d: session %r after recovery: %s", h.index, name, exc.cause)
                    continue
                for answer in standing:
                    hub.publish(name, "standing", answer)
                hub.publish(name, "data", name, info.data_version)
            return batch.next_seq
        except Exception as exc:
            self.cluster.mark_down(h, exc)
            return 0
