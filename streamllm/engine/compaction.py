"""Compaction: keep a session inside its context budget without ever stopping it.

A second copy is built in fresh blocks: the frozen prefix, then the most recent data
lines (up to `retain` of max_context), then every line pushed meanwhile. When the copy
has caught up with what the session has computed, the core swaps it in between two
steps. Until then the session keeps ingesting and answering on its old blocks;
branches already forked keep their own references.

    old:   [prefix | oldest ... | cut | recent lines | new lines ...]
    copy:  [prefix |                  recent lines | new lines ...]   -> swapped in

How the recent lines get their cells (`CompactionPolicy.method`):
- "shift" (the default): the cells the session computed are moved, keys turned by RoPE to
  their new positions (LlamaForward.shift_keys), values as they are, a chunk between two
  steps (a long copy never holds a waiting question for long): no forward pass. The moved
  lines keep what they read when computed, the cut lines included, as StreamingLLM keeps a
  window after its attention sinks (here the frozen prefix). `streamllm bench compaction`
  measures it against "recompute" on recorded bars (docs/engine.md says why it is the default).
- "recompute": the copy runs the recent lines through the model again after the prefix,
  as background work: exactly a fresh session of those lines, at the price of their prefill
  (about twice the tokens ingested, started early under a fast feed).

The copy starts on the session's own prefix blocks (shared, not recomputed) and copies
only what the session has computed: started when the session is at its budget, it needs
at most `retain` x max_context cells (`CompactionPolicy.copy_cells`), which admission
keeps free beside every session's reservation (`Compactor.keep_free`, compacting.py).

When to start: a shifted copy at `compact_at`; one that recomputes early enough, at the
session's measured push rate, to finish before the session reaches max_context, but never
so early that it frees too little for what it recomputes (`CompactionPolicy.should_start`).
A session that reaches its budget anyway keeps accepting pushes; its pending data waits
(a recomputing copy is promoted to the ingest class) until the swap makes room. If its
copy finds no cells, copies are redoable work: the core preempts them as vLLM preempts
requests (`Compactor.keep_moving`, compacting.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamllm.engine.kv import BlockTable
from streamllm.engine.sequence import Logits, SchedClass, Sequence, Session


@dataclass(slots=True, eq=False)
class CompactionCopy(Sequence):
    session: Session
    cut: int  # token index in the session (a line boundary) where retained data starts
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    shifts: bool = False  # its cells are moved, a chunk a turn (Compactor.shift_some), never computed
    want_logits = Logits.NONE  # type: ignore[misc]  # a copy of data: nothing to answer at its end

    @property
    def target_ids(self) -> list[int]:
        return self.session.retained_ids(self.cut)

    @property
    def pending_ids(self) -> list[int]:  # type: ignore[override]
        # Never past what the session has computed: the session ingests the rest after the swap,
        # so a copy's size is bounded by its cut, not by how much is pushed meanwhile.
        if self.shifts:
            return []  # nothing for the scheduler: its cells are moved between steps
        return self.target_ids[self.num_computed : self.session_computed_mapped()]

    @property
    def next_pos(self) -> int:  # type: ignore[override]
        return self.num_computed

    @property
    def session_name(self) -> str:  # type: ignore[override]
        return self.session.name

    @property
    def tenant(self) -> str:  # type: ignore[override]
        return self.session.tenant

    @property
    def sched_class(self) -> SchedClass:  # type: ignore[override]
        # A session stuck at its budget ingests nothing until the swap: the copy *is* its ingest.
        return SchedClass.INGEST if self.session.at_budget else SchedClass.BACKGROUND

    def session_computed_mapped(self) -> int:
        """How far the session has computed, in the copy's coordinates."""
        s = self.session
        return s.prefix_len + max(0, s.num_computed - self.cut)

    def cells_to_go(self) -> int:
        """Cells this copy still needs, as far as its session can compute what is pushed now."""
        return max(0, copy_size(self.session, self.cut) - self.table.num_tokens)

    def to_shift(self) -> int:
        """Tokens the session has computed that a shifting copy has not moved yet."""
        return max(0, self.session_computed_mapped() - self.num_computed) if self.shifts else 0

    def tokens_computed(self) -> int:
        """Tokens this copy ran through the model (none when it shifts: it moved them)."""
        return 0 if self.shifts else self.num_computed - self.session.prefix_len

    def caught_up(self) -> bool:
        return self.num_computed >= self.session_computed_mapped()


def copy_size(session: Session, cut: int) -> int:
    """Tokens a copy cut at `cut` holds when it catches up with everything its session can compute."""
    return session.prefix_len + max(0, min(session.num_tokens, session.max_context) - cut)


METHODS = ("shift", "recompute")


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    compact_at: float = 0.75  # start at the latest when the session holds this share of max_context
    retain: float = 0.5  # share of max_context the copy keeps (prefix included)
    safety: float = 2.0  # start when the budget left lasts less than safety x the copy's estimated time
    # How a copy gets the retained lines' cells: "shift" moves the cells the session computed (keys turned
    # to their new positions), "recompute" runs them through the model again after the prefix.
    method: str = "shift"

    def __post_init__(self) -> None:
        if not 0 < self.retain < self.compact_at <= 1:
            raise ValueError(f"need 0 < retain < compact_at <= 1, got retain={self.retain}, "
                             f"compact_at={self.compact_at}")
        if self.method not in METHODS:
            raise ValueError(f"CompactionPolicy.method must be one of {', '.join(METHODS)}, got {self.method!r}")

    @property
    def earliest(self) -> float:
        """The share of max_context before which no copy starts early (see should_start)."""
        return (self.retain + self.compact_at) / 2

    def keep_tokens(self, session: Session) -> int:
        # A system prompt over retain x max_context keeps no data, rather than never compacting
        # (a session that cannot compact waits at its budget forever).
        return max(0, int(self.retain * session.max_context) - session.prefix_len)

    def copy_cells(self, max_context: int) -> int:
        """The most cells a copy started at its session's budget takes from the pool: its prefix
        blocks are shared, and the cut is taken from everything pushed, so at most keep_tokens of
        data follow it."""
        return int(self.retain * max_context)

    def keep_free(self, branch_cells: int, largest_max_context: int) -> int:
        """Cells admission leaves free beside every session's reservation: those kept for questions,
        or a compaction copy of the largest session at its budget, whichever is more."""
        return max(branch_cells, self.copy_cells(largest_max_context))

    def should_start(self, session: Session, copy_tokens_per_s: float) -> bool:
        """At compact_at of the budget, or (copies that recompute) earlier when pushes would fill it before a
        copy finishes; a shifted copy is made in a few turns between steps.

        Never before halfway from retain to compact_at: a copy recomputes up to retain x max_context
        tokens to free what the session holds beyond that, so one started just past retain frees a
        line or two, and under a fast feed every swap would start the next. From halfway a copy costs
        at most twice what one at compact_at does per token freed; a feed faster still waits at the
        budget briefly.
        """
        if session.num_tokens >= self.compact_at * session.max_context:
            return True
        if self.method == "shift" or session.num_tokens < self.earliest * session.max_context:
            return False  # no copy to race, or too little to cut for what the copy recomputes
        rate = session.push_rate()
        if rate <= 0 or copy_tokens_per_s <= 0:
            return False
        seconds_left = (session.max_context - session.num_tokens) / rate
        copy_seconds = self.retain * session.max_context / copy_tokens_per_s
        return seconds_left <= self.safety * copy_seconds
