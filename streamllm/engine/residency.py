"""Sessions on and off the pool: snapshots, restores and evictions, seen from the facade.

An evicted session is a snapshot file: its cells are free, its name stays taken, and its
next push, ask or register restores it first (`_ensure_resident`). Files and formats:
streamllm/durability/snapshot.py; this mixin keeps the facade's registry in step.
"""

from __future__ import annotations

from concurrent.futures import Future

from streamllm.engine.intake import _Handle
from streamllm.engine.outputs import SessionInfo


class Residency:
    """Mixed into `Engine` (api.py), whose registry (`_handles`, `_evicted`, `_lock`, ...) it uses."""

    def snapshot_session(self, name: str, path):
        """Save the session's cells and bookkeeping to `path` (atomic); it keeps running."""
        from streamllm.durability.snapshot import save_session

        self._ensure_resident(name)
        return save_session(self, name, path)

    def restore_session(self, path, name: str | None = None):
        """Open a session from a snapshot (validated first: model, checksum, counts, versions)."""
        from streamllm.durability.snapshot import restore_session

        info = restore_session(self, path, name)
        if self.ingest_log is not None:
            self.ingest_log.record_restore(info.session, path, info.data_version)
        return info

    def evict_session(self, name: str, directory) -> str:
        """Free an idle session's cells: snapshot it to `directory`; its next push or ask restores it."""
        from streamllm.durability.snapshot import evict_session

        with self._log_lock(name), self._residency:  # close_session's lock order
            return evict_session(self, name, directory)

    def _submit_resident(self, name: str, cmd) -> Future:
        """Submit a command on a resident session: no eviction slips between the check and the inbox."""
        while True:
            self._ensure_resident(name)
            with self._lock:
                if name not in self._evicted:
                    self._handle(name)
                    return self.core.submit(cmd)

    def _ensure_resident(self, name: str) -> None:
        if name not in self._evicted:
            return
        from streamllm.durability.snapshot import restore_evicted

        with self._residency:
            restore_evicted(self, name)

    def _adopt(self, name: str, info: SessionInfo) -> None:
        """Called by snapshot restore: keep the facade's registry in step with the core."""
        with self._lock:
            self._evicted.pop(name, None)
            self._evicted_info.pop(name, None)
            self._handles[name] = _Handle(info.max_context, info.prefix_tokens, info.pushed_version,
                                          info.lines_ingested + info.backlog_lines)
