"""Memory pressure: when the cell pool cannot admit a session, idle sessions go to disk.

    open_session / restore-on-use refused for want of cells
      -> evict resident sessions, least recently asked first, skipping busy ones
         (pending ingest, questions, compaction or entries in flight), until the request fits
      -> retry once; each evicted session comes back on its next push / ask (`restore_evicted`),
         which may in turn evict another one

Enabled with `enable_auto_evict(engine, directory)`; `engine.stats()` then reports
`auto_evictions` and `auto_restores`. Evicted sessions keep their subscribers and their
ingest log; their snapshot file is deleted once restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamllm.durability.files import make_dirs
from streamllm.durability.snapshot import SnapshotError, evict_session


class AutoEvict:
    def __init__(self, directory: str | Path, *, wait_s: float = 2.0) -> None:
        self.directory = make_dirs(directory)
        self.wait_s = wait_s  # once, when every candidate is busy: let the engine settle and retry
        self.evictions = self.restores = self.refusals = 0

    def stats(self) -> dict[str, int]:
        return {"auto_evictions": self.evictions, "auto_restores": self.restores,
                "auto_evict_refusals": self.refusals}

    def make_room(self, engine: Any, cells: int, exclude: set[str]) -> bool:
        """Evict idle sessions until `cells` can be reserved; False when it cannot be done."""
        with engine._residency:
            for attempt in range(2):
                if self._fits(engine, cells):
                    return True
                with engine._lock:
                    resident = [n for n in engine._handles if n not in exclude]
                for name in sorted(resident, key=lambda n: engine.last_asked.get(n, 0.0)):
                    try:
                        evict_session(engine, name, self.directory)
                    except SnapshotError:  # busy (or could not write): try the next one
                        continue
                    self.evictions += 1
                    if self._fits(engine, cells):
                        return True
                if attempt == 0:
                    engine.wait_idle(timeout=self.wait_s)
            self.refusals += 1
            return self._fits(engine, cells)

    @staticmethod
    def _fits(engine: Any, cells: int) -> bool:
        return engine.call(lambda core: core.store.manager.can_reserve(
            cells, keep_free_tokens=core.admission_keep_free(cells)))  # the core's own admission rule


def enable_auto_evict(engine: Any, directory: str | Path) -> AutoEvict:
    engine.auto_evict = AutoEvict(directory)
    return engine.auto_evict
