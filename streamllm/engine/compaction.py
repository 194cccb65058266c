"""Compaction: keep a session inside its context budget without ever stopping it.

When a session passes `compact_at` of its max_context, a second copy is built in
fresh blocks as idle work: the frozen prefix, then the most recent data lines (up to
`retain` of max_context), then every line pushed meanwhile. When the copy has caught
up with what the session has computed, the engine swaps it in between two steps.
Until then the session keeps ingesting and answering on its old blocks; branches
already forked keep their own references, so nothing in flight is disturbed.

    old:   [prefix | oldest ... | cut | recent lines | new lines ...]
    copy:  [prefix |                  recent lines | new lines ...]   -> swapped in
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamllm.engine.kv import BlockTable
from streamllm.engine.sequence import Session


@dataclass(slots=True, eq=False)
class Compaction:
    session: Session
    cut: int  # token index in the session (a line boundary) where retained data starts
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    want_logits = "none"  # a copy of data: nothing to answer at its end

    @property
    def target_ids(self) -> list[int]:
        return self.session.retained_ids(self.cut)

    @property
    def pending_ids(self) -> list[int]:
        return self.target_ids[self.num_computed :]

    @property
    def next_pos(self) -> int:
        return self.num_computed

    def session_computed_mapped(self) -> int:
        """How far the session has computed, in the copy's coordinates."""
        s = self.session
        return s.prefix_len + max(0, s.num_computed - self.cut)

    def caught_up(self) -> bool:
        return self.num_computed >= self.session_computed_mapped()
