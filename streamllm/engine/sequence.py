"""Sequences: anything the model computes tokens for, owned by the core.

One rule for all of them: a sequence has token ids, counts how many are computed,
holds a block table, and its next token sits at `next_pos`. Chunked prefill, resume
and branches follow from `num_computed`; the scheduler plans any sequence the same
way and never asks what it is.

    Session         [prefix | batch 1 | batch 2 | batch 3 (pending)]           INGEST
    AskBranch       session@v2 + [Question ... <assistant>] + generated         INTERACTIVE
    EntryBranch     session@v2 + [Question ... <assistant>] -> ready logits     BACKGROUND*
    DecodeBranch    entry + generated (a standing answer decoded off the critical path)  BACKGROUND
    CompactionCopy  [prefix | recent lines ...] in fresh blocks                 BACKGROUND

    * an entry that an ask is waiting for is INTERACTIVE.

    version_ends: [p, e1, e2, e3]: data_version = 2 once e2 <= num_computed.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

import torch

from streamllm.engine.kv import BlockTable
from streamllm.engine.outputs import AnswerPath, FinishReason, SessionInfo
from streamllm.engine.taps import LineTaps

if TYPE_CHECKING:
    from streamllm.engine.standing.gate import Gate
    from streamllm.engine.standing.prepos import Standing


class SchedClass(StrEnum):
    """The batcher's three classes, served in this order (scheduler.py)."""

    INTERACTIVE = "interactive"
    INGEST = "ingest"
    BACKGROUND = "background"


class Logits(StrEnum):
    """Which logits a step's chunk of a sequence returns."""

    LAST = "last"  # at the chunk's last token (a branch's next token, an entry's ready distribution)
    ALL = "all"  # at every token (benches, parity tests)
    NONE = "none"  # none (data: sessions and compaction copies)


class BranchKind(StrEnum):
    ASK = "ask"  # a question someone waits for
    ENTRY = "entry"  # a standing question's pre-paid prefill, kept after it completes
    DECODE = "decode"  # a standing answer decoded from an entry as background work


class Sequence:
    """Base: what the scheduler and runner need. Subclasses say which tokens are pending."""

    __slots__ = ()
    want_logits: ClassVar[Logits] = Logits.LAST
    table: BlockTable
    num_computed: int

    @property
    def pending_ids(self) -> list[int]:
        raise NotImplementedError

    @property
    def next_pos(self) -> int:
        raise NotImplementedError

    @property
    def session_name(self) -> str:
        raise NotImplementedError

    @property
    def tenant(self) -> str:
        """The tenant of the session this sequence serves (fairness groups by it)."""
        raise NotImplementedError

    @property
    def sched_class(self) -> SchedClass:
        raise NotImplementedError


class Session(Sequence):
    """One persistent context: frozen prefix + data lines, with its data versions."""

    __slots__ = ("name", "tenant", "system", "max_context", "working_set", "table", "token_ids", "prefix_len", "num_computed",
                 "version_ends", "version_lines", "data_version", "lines_ingested", "line_ends",
                 "compactions", "tokens_dropped", "opened_at", "version_base", "push_times", "lines_cut", "taps")
    want_logits = Logits.NONE
    sched_class = SchedClass.INGEST  # type: ignore[assignment]

    def __init__(self, name: str, system: str, prefix_ids: list[int], max_context: int, table: BlockTable,
                 tenant: str = "", working_set: int | None = None) -> None:
        self.name = name
        self.tenant = tenant  # who the session belongs to, as told at open; the scheduler is fair across tenants
        self.system = system
        self.max_context = max_context
        # Cells it was admitted for and always holds (engine/admission.py); it grows past them up to max_context.
        self.working_set = max_context if working_set is None else working_set
        self.table = table
        self.token_ids: list[int] = list(prefix_ids)
        self.prefix_len = len(prefix_ids)
        self.num_computed = 0
        # version_ends[i - version_base] is where version i ends; versions before the last
        # compaction are forgotten (bounded memory), their lines counted in lines_ingested.
        self.version_base = 0
        self.version_ends = [len(prefix_ids)]
        self.version_lines = [0]
        self.data_version = 0
        self.lines_ingested = 0
        self.line_ends: deque[int] = deque()  # token index after each data line (compaction cuts there)
        self.lines_cut = 0  # lines compacted away: line_ends[0] ends line number lines_cut
        self.taps: LineTaps | None = None  # per-line features, when the engine serves series heads
        self.compactions = 0
        self.tokens_dropped = 0
        self.opened_at = time.time()
        self.push_times: deque[tuple[float, int]] = deque(maxlen=32)  # (monotonic time, tokens) per push

    @property
    def session_name(self) -> str:  # type: ignore[override]
        return self.name

    @property
    def ready(self) -> bool:
        """The frozen prefix is computed: questions can fork."""
        return self.num_computed >= self.prefix_len

    @property
    def pushed_version(self) -> int:
        return self.version_base + len(self.version_ends) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def pending_ids(self) -> list[int]:  # type: ignore[override]
        """Pending data that fits the session's budget; the rest waits for compaction."""
        return self.token_ids[self.num_computed : self.max_context]

    @property
    def next_pos(self) -> int:  # type: ignore[override]
        return self.num_computed

    def info(self) -> SessionInfo:
        return SessionInfo(self.name, self.data_version, self.pushed_version, self.num_tokens, self.num_computed,
                           self.prefix_len, self.max_context, self.backlog_lines, self.lines_ingested, self.compactions,
                           self.tenant)

    @property
    def backlog_lines(self) -> int:
        return sum(self.version_lines[self.data_version - self.version_base + 1 :])

    @property
    def at_budget(self) -> bool:
        """Pending data cannot be computed until a compaction makes room."""
        return self.pending_tokens > 0 and self.num_computed >= self.max_context

    def append_batch(self, ids_per_line: list[list[int]], now: float) -> int:
        n = 0
        for ids in ids_per_line:
            self.token_ids.extend(ids)
            self.line_ends.append(len(self.token_ids))
            n += len(ids)
        self.version_ends.append(len(self.token_ids))
        self.version_lines.append(len(ids_per_line))
        self.push_times.append((now, n))
        return self.pushed_version

    def push_rate(self, min_span_s: float = 1.0) -> float:
        """Tokens per second pushed recently; 0 until pushes span min_span_s (a burst is no rate)."""
        if len(self.push_times) < 2:
            return 0.0
        span = self.push_times[-1][0] - self.push_times[0][0]
        return sum(n for _, n in list(self.push_times)[1:]) / span if span >= min_span_s else 0.0

    def advance(self, num_tokens: int) -> bool:
        """Count computed tokens; returns whether the data version moved."""
        self.num_computed += num_tokens
        before = self.data_version
        while (self.data_version < self.pushed_version
               and self.version_ends[self.data_version - self.version_base + 1] <= self.num_computed):
            self.data_version += 1
            self.lines_ingested += self.version_lines[self.data_version - self.version_base]
        return self.data_version != before

    def lines_upto(self, token: int) -> int:
        """Number of data lines (counted from the session's first) that end at or before `token`."""
        return self.lines_cut + bisect_right(self.line_ends, token)

    def tap(self, rows: torch.Tensor, start: int, ids: list[int]) -> None:
        """Fold the tapped residual rows of tokens [start, start + len(rows)) (ids: their tokens) into the line features."""
        self.taps.add(rows, start, ids, self.line_ends, self.lines_cut, self.prefix_len)

    def version_length(self, version: int) -> int:
        return self.version_ends[version - self.version_base]

    # -- compaction ---------------------------------------------------------
    def compaction_cut(self, keep_tokens: int) -> int | None:
        """The line boundary after which at most keep_tokens data tokens remain (None: nothing to cut)."""
        for end in self.line_ends:
            if self.num_tokens - end <= keep_tokens:
                return end if end > self.prefix_len else None
        return None

    def retained_ids(self, cut: int) -> list[int]:
        """The token ids after compacting at `cut`: frozen prefix, then the data after the cut."""
        return self.token_ids[: self.prefix_len] + self.token_ids[cut:]

    def apply_compaction(self, cut: int, table: BlockTable, num_computed: int) -> None:
        """Swap in the compacted copy (its table holds the first num_computed retained tokens).

        Versions whose data was cut away are forgotten, so bookkeeping stays bounded by
        the context budget, not by uptime."""
        shift = cut - self.prefix_len
        self.token_ids = self.retained_ids(cut)
        ends = [max(self.prefix_len, end - shift) for end in self.version_ends]
        first = 0  # the newest version whose end is at or before the cut (now the prefix)
        while first + 1 < len(ends) and ends[first + 1] <= self.prefix_len:
            first += 1
        first = min(first, self.data_version - self.version_base)  # keep the current version addressable
        self.version_base += first
        self.version_ends = ends[first:]
        self.version_lines = self.version_lines[first:]
        kept = deque(end - shift for end in self.line_ends if end > cut)
        self.lines_cut += len(self.line_ends) - len(kept)
        self.line_ends = kept
        self.table = table
        self.num_computed = num_computed
        self.tokens_dropped += shift
        self.compactions += 1
        self.advance(0)


@dataclass(slots=True, eq=False)
class Branch(Sequence):
    """A sequence forked off a session at a data version, on its own blocks; it never changes
    the session. What it is for is its type: `AskBranch`, `EntryBranch` or `DecodeBranch`."""

    kind: ClassVar[BranchKind]
    session: Session
    question: str
    prompt_ids: list[int]
    standing: Standing | None = None  # the standing question this branch serves (entries, decodes, standing asks)
    choices: Gate | None = None  # a choice question's gate: its answer is always one of the choices
    table: BlockTable | None = None
    base_len: int = 0
    data_version: int = 0
    num_computed: int = 0  # of `ids`
    first_logits: torch.Tensor | None = None  # the distribution at the decision point

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids

    @property
    def pending_ids(self) -> list[int]:  # type: ignore[override]
        return self.ids[self.num_computed :]

    @property
    def next_pos(self) -> int:  # type: ignore[override]
        return self.base_len + self.num_computed

    @property
    def session_name(self) -> str:  # type: ignore[override]
        return self.session.name

    @property
    def tenant(self) -> str:  # type: ignore[override]
        return self.session.tenant


@dataclass(slots=True, eq=False)
class EntryBranch(Branch):
    """A standing question's prefill up to its decision point, kept (with its ready logits) once done."""

    kind: ClassVar[BranchKind] = BranchKind.ENTRY

    @property
    def sched_class(self) -> SchedClass:  # type: ignore[override]
        waited_for = self.standing is not None and self.standing.waiters
        return SchedClass.INTERACTIVE if waited_for else SchedClass.BACKGROUND


@dataclass(slots=True, eq=False)
class DecodingBranch(Branch):
    """A branch that generates tokens after its prompt (asks and standing decodes)."""

    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    prepaid: int = 0  # tokens whose KV came with the entry (not computed for this answer)
    finish_reason: FinishReason = FinishReason.LENGTH
    text: str = ""
    path: AnswerPath = AnswerPath.COLD
    confidence: float | None = None

    @property
    def ids(self) -> list[int]:  # type: ignore[override]
        return self.prompt_ids + self.generated


@dataclass(slots=True, eq=False)
class DecodeBranch(DecodingBranch):
    """A standing answer decoded from its entry as background work (free-text push questions)."""

    kind: ClassVar[BranchKind] = BranchKind.DECODE

    @property
    def sched_class(self) -> SchedClass:  # type: ignore[override]
        return SchedClass.BACKGROUND


@dataclass(slots=True, eq=False)
class AskBranch(DecodingBranch):
    """A question someone waits for: answered into its future."""

    kind: ClassVar[BranchKind] = BranchKind.ASK
    future: Future | None = None
    min_version: int = 0
    on_text: Callable[[str], None] | None = None  # called with each decoded delta (streaming), core thread
    t_start: float = field(default_factory=time.perf_counter)
    keep_logits: bool = False
    choice_probs: dict[str, float] | None = None
    stale: bool = False
    ask_id: int = 0  # the facade's, in submission order: the newest is preempted first
    deadline_s: float | None = None  # dropped with AskTimeout this long after t_start; None: never
    preempted: int = 0  # times its cells were taken back (it is recomputed from its data version)

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_s is None else self.t_start + self.deadline_s

    @property
    def sched_class(self) -> SchedClass:  # type: ignore[override]
        return SchedClass.INTERACTIVE
