"""Pre-positioning: keep every standing question's entry at its session's newest data.

An entry is a branch holding the question's tokens on top of the session at one
data version, plus the ready distribution (logits at the decision point). After
each ingested batch the entries of that session go stale and are recomputed as
background work. Asking a standing question then costs a gate decision (fast path)
or decoding from the entry (entry path), never the question's prefill.

    session  [prefix | data ... v7]
    entry    [prefix | data ... v7 | Question: ...<assistant>] -> ready logits @ v7

Bounded lag: an entry already computing for an older version is allowed to finish
(it is the freshest answer we will have soon); a new one starts after it. Every
time an entry completes, its `ReadyRecord` is published for callers to read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from streamllm.config import QuestionSpec, normalize_question
from streamllm.engine.kv import KVCapacityError, KVStore
from streamllm.engine.outputs import AnswerPath, ReadyRecord, StandingAnswer
from streamllm.engine.sequence import (
    AskBranch,
    Branch,
    DecodeBranch,
    DecodingBranch,
    EntryBranch,
    Session,
)
from streamllm.engine.standing.calibration import LiveCalibration, calibration_for
from streamllm.engine.standing.gate import Gate, GateDecision
from streamllm.engine.standing.learning import Learner, Learning, head_window
from streamllm.model.adapter import HeadKind


def find_standing(questions: Iterable[QuestionSpec], query: str) -> QuestionSpec | None:
    """The standing question with this id, or with this text up to whitespace and case."""
    questions = list(questions)
    for spec in questions:
        if spec.id == query:
            return spec
    normalized = normalize_question(query)
    for spec in questions:
        if spec.normalized_text == normalized:
            return spec
    return None


def answers_alone(spec: QuestionSpec, fired: bool, token_id: int, max_tokens: int, eos_ids: set[int]) -> bool:
    """Whether the gate's view alone is the whole answer: a choice question, or a fired gate on an
    answer one token long (max_tokens 1, or the top token ends the turn)."""
    return bool(spec.choices) or (fired and (max_tokens == 1 or token_id in eos_ids))


def is_final(rec: ReadyRecord, spec: QuestionSpec, max_tokens: int, eos_ids: set[int]) -> bool:
    """Whether the ready record alone answers an ask of `max_tokens` (`rec.final` is this at the spec's own)."""
    return answers_alone(spec, rec.fired, rec.token_id, max_tokens, eos_ids)


@dataclass(slots=True, eq=False)
class Standing:
    """One standing question on one session, with its newest entries."""

    session: Session
    spec: QuestionSpec
    gate: Gate
    prompt_ids: list[int]
    computing: EntryBranch | None = None  # entry being prefilled
    ready: EntryBranch | None = None  # newest entry whose ready distribution is known
    decoding: DecodeBranch | None = None  # standing-answer decode (free-text push questions)
    answer: StandingAnswer | None = None
    record: ReadyRecord | None = None  # published view of `ready`
    # What `ready`'s head reads: the final normed hidden state at its decision point (entry head)
    # or the session's line features up to it (series head); None without a head.
    ready_hidden: torch.Tensor | None = None
    waiters: list[AskBranch] = field(default_factory=list)  # asks waiting for a fresh entry
    entries_computed: int = 0
    calibration: LiveCalibration = field(default_factory=LiveCalibration)  # answers scored against labels
    learner: Learner | None = None  # a labelled question without a head of its own learns one (engine/standing/learning.py)

    @property
    def ready_logits(self) -> torch.Tensor | None:
        return None if self.ready is None else self.ready.first_logits

    def fresh(self) -> bool:
        return self.ready is not None and self.ready.data_version == self.session.data_version

    def branches(self) -> list[Branch]:
        return [b for b in (self.computing, self.ready, self.decoding) if b is not None]


class Prepositioner:
    """Standing questions per session, their entries and standing answers (core-owned bookkeeping)."""

    def __init__(self, store: KVStore, eos_ids: set[int], *, head_entries: bool = True,
                 learning: Learning | None = None) -> None:
        self.store = store
        self.learning = learning
        self.eos_ids = eos_ids
        # A choice question a series head decides reads the session's line features, not the entry's
        # forward pass: its entry is made from them alone, with no prefill (and no LM logits).
        self.head_entries = head_entries
        self.head_only_entries = 0
        # Entries that became a question's ready entry, every question's ever (a question's own count,
        # `Standing.entries_computed`, leaves with it when its session is closed or evicted).
        self.entries_computed = 0
        self.by_session: dict[str, dict[str, Standing]] = {}
        self.entry_tokens = 0  # background compute spent on entries (tokens)
        self.entries_evicted = 0
        self.entries_preempted = 0  # entries computing whose cells went back when every one was blocked
        # Free blocks that sessions blocked on growth are owed (set by Admission.relieve each turn): new
        # entries start only beside them, so ingest is not evicted for background work that takes it back.
        self.held_blocks = 0

    # -- registry ----------------------------------------------------------
    def register(self, session: Session, spec: QuestionSpec, gate: Gate, prompt_ids: list[int]) -> Standing:
        questions = self.by_session.setdefault(session.name, {})
        if spec.id in questions:
            raise ValueError(f"session {session.name!r} already has a standing question {spec.id!r}")
        st = Standing(session, spec, gate, list(prompt_ids),
                      calibration=calibration_for(spec))
        if self.learning is not None and self.learning.wants(st):
            st.learner = Learner(self.learning.config, tuple(spec.choices), self.learning.config.lines_for(spec.label))
        questions[spec.id] = st
        return st

    def unregister(self, session: str, question_id: str) -> Standing:
        st = self.by_session.get(session, {}).pop(question_id, None)
        if st is None:
            raise KeyError(f"session {session!r} has no standing question {question_id!r}")
        self._drop(st)
        return st

    def drop_session(self, session: str) -> list[Standing]:
        dropped = list(self.by_session.pop(session, {}).values())
        for st in dropped:
            self._drop(st)
        return dropped

    def release(self, branch: Branch | None) -> None:
        """Give a branch's cells back (idempotent)."""
        if branch is not None and branch.table is not None:
            self.store.manager.free(branch.table)
            branch.table = None

    def _drop(self, st: Standing) -> None:
        if self.learning is not None:
            self.learning.drop(st)
        for br in st.branches():
            self.release(br)
        st.computing = st.ready = st.decoding = None
        st.record = None

    def find(self, session: str, query: str) -> Standing | None:
        questions = self.by_session.get(session, {})
        spec = find_standing((st.spec for st in questions.values()), query)
        return None if spec is None else questions[spec.id]

    def standing(self, session: str) -> list[Standing]:
        return list(self.by_session.get(session, {}).values())

    def all(self) -> list[Standing]:
        return [st for qs in self.by_session.values() for st in qs.values()]

    # -- entries -------------------------------------------------------------
    def refresh(self, keep_free_blocks: int = 0) -> list[EntryBranch]:
        """Start an entry at the newest data version for every question that lacks one, leaving
        keep_free_blocks free (compaction copies in flight need them more than entries do).
        Returns the entries that need no forward pass (head-only: ready now, for the core to finish)."""
        manager = self.store.manager
        instant = []
        owed: int | None = None  # blocks the entries computing still need (counted once something would start)
        for st in self.all():
            s = st.session
            if not s.ready or st.fresh():
                continue
            if self._head_only(st):
                self.release(st.computing)  # an older prefill in flight is not needed any more
                st.computing = EntryBranch(s, st.spec.text, st.prompt_ids, base_len=s.version_length(s.data_version),
                                           data_version=s.data_version, standing=st, choices=st.gate)
                instant.append(st.computing)
                continue
            if st.computing is not None:
                if st.computing.data_version == s.data_version or st.computing.num_computed > 0:
                    continue  # current, or part-paid for an older version: let it finish
                self.release(st.computing)  # not started: restart at the newest
                st.computing = None
            if owed is None:
                owed = self.blocks_to_finish()
            need = self.start_blocks(st)
            if manager.num_free_blocks < keep_free_blocks + self.held_blocks + owed + need:
                continue  # optional work, started only whole beside the others: retry when cells free up
            try:
                table = self.store.fork(s.table, s.version_length(s.data_version))
            except KVCapacityError:
                continue
            owed += manager.blocks_needed(table, len(st.prompt_ids))
            st.computing = EntryBranch(s, st.spec.text, st.prompt_ids, table=table,
                                       base_len=s.version_length(s.data_version), data_version=s.data_version,
                                       standing=st, choices=st.gate if st.spec.choices else None)
        return instant

    def start_blocks(self, st: Standing) -> int:
        """Blocks a new entry of `st` takes: its fork's partial tail, then its question's tokens."""
        m, s = self.store.manager, st.session
        return m.blocks_for(s.version_length(s.data_version) % m.block_size + len(st.prompt_ids))

    def blocks_to_finish(self) -> int:
        """Blocks the entries computing still need to land."""
        m = self.store.manager
        return sum(m.blocks_needed(e.table, len(e.pending_ids)) for e in self.computing())

    def computing(self) -> list[EntryBranch]:
        """Entries being prefilled on cells of their own (head-only entries hold none)."""
        return [st.computing for st in self.all() if st.computing is not None and st.computing.table is not None]

    def preempt(self, entry: EntryBranch) -> None:
        """Free an entry computing's cells (vLLM v1's preemption, for background work): `refresh` starts
        its question again, at the newest data, once the pool holds the whole entry beside the others."""
        st = entry.standing
        self.release(entry)
        if st.computing is entry:
            st.computing = None
        self.entries_preempted += 1

    def _head_only(self, st: Standing) -> bool:
        """Whether the newest entry can come from the session's line features alone: a choice question
        (never decoded on) whose series head has all its lines at the newest data version."""
        head, s = st.gate.head, st.session
        if not (self.head_entries and st.spec.choices and head is not None and head.kind == HeadKind.SERIES
                and s.taps is not None):
            return False
        upto = s.lines_upto(s.version_length(s.data_version))
        return s.taps.holds(upto, head.reads(upto))

    def jobs(self) -> list[Branch]:
        """Entries computing and standing-answer decodes (their class follows from waiters)."""
        standing = self.all()
        return ([st.computing for st in standing if st.computing is not None]
                + [st.decoding for st in standing if st.decoding is not None])

    def wants_hidden(self, seq: object) -> bool:
        """An entry whose question has an entry head needs the hidden state of its last row."""
        return (isinstance(seq, EntryBranch) and seq.standing.gate.head is not None
                and seq.standing.gate.head.kind == HeadKind.ENTRY)

    def on_entry_ready(self, entry: EntryBranch, logits: torch.Tensor | None,
                       hidden: torch.Tensor | None = None) -> Standing | None:
        st: Standing = entry.standing
        self.entry_tokens += entry.num_computed
        if st.computing is not entry:  # unregistered (or its session closed) meanwhile
            self.release(entry)
            return None
        self.head_only_entries += entry.table is None
        self.entries_computed += 1
        entry.first_logits = logits
        self.release(st.ready)
        st.ready, st.computing = entry, None
        st.ready_hidden = None if hidden is None else hidden.clone()
        head, taps = st.gate.head, st.session.taps
        if taps is not None:
            upto = st.session.lines_upto(entry.base_len)  # the lines the entry saw: those ending at its fork point
            if head is not None and head.kind == HeadKind.SERIES:
                st.ready_hidden = head_window(taps, head, upto)  # None until enough are held
            if st.learner is not None:  # what this answer read, for its sample
                st.learner.saw(entry.data_version, upto, taps)
        st.entries_computed += 1
        st.record = self._record(st)
        self._score(st)
        return st

    def expect(self, session: str, version: int, truths: dict[str, str]) -> list[Standing]:
        """Truths at `version` (question id -> the right choice there): sent with the push that makes
        it, or later for a forecast. Returns the questions whose waiting answer this scored."""
        questions = self.by_session.get(session, {})
        scored = []
        for question_id, choice in truths.items():
            st = questions.get(question_id)
            if st is None or not st.spec.choices:  # unregistered meanwhile: nothing to score
                continue
            if st.calibration.expect(version, choice, st.gate.effective_threshold):
                self.sync_gate(st)
                self._learn(st)
                scored.append(st)
        return scored

    def _score(self, st: Standing) -> None:
        """Score the new ready answer against its version's truth; a live threshold follows the evidence."""
        rec, cal = st.record, st.calibration
        if not st.spec.choices or not cal.score(rec.data_version, rec.text, rec.confidence, rec.fired,
                                                st.gate.effective_threshold):
            return
        self.sync_gate(st)
        self._learn(st)

    def _learn(self, st: Standing) -> None:
        """After its score, never before: the answer's own sample joins what its question learns from."""
        if st.learner is not None and self.learning is not None and st.calibration.last_scored is not None:
            self.learning.scored(st, *st.calibration.last_scored)

    def swap_learned(self) -> list[Standing]:
        """Between steps: learned heads whose fits finished take over their questions' gates."""
        if self.learning is None:
            return []
        return self.learning.swap_finished()

    @staticmethod
    def sync_gate(st: Standing) -> None:
        """An auto gate takes its calibration's live thresholds (the next decision uses them)."""
        if st.gate.auto:
            st.gate.threshold, st.gate.choice_thresholds = st.calibration.threshold, dict(st.calibration.thresholds)

    def _record(self, st: Standing) -> ReadyRecord:
        d = self.decide(st)
        final = answers_alone(st.spec, d.fired, d.token_id, st.spec.max_tokens, self.eos_ids)
        threshold, source = threshold_in_force(st.gate, d.answer or "", head_read=st.ready_hidden is not None)
        return ReadyRecord(st.session.name, st.spec.id, st.ready.data_version, d.fired, final,
                           d.answer or "", d.token_id, d.gap, d.probs, st.ready.first_logits,
                           warming_up(st), threshold, source)

    def evict_idle_entries(self, busy_sessions: set[str], computing: bool = False, stale_only: bool = False) -> int:
        """Free the ready entries of sessions nobody is using now (recomputable); returns blocks freed.
        computing: entries being prefilled that nobody waits for go too (under real pressure);
        stale_only: only ready entries behind their session's data (their replacements are coming)."""
        freed = 0
        for st in self.all():
            if computing and st.computing is not None and not st.waiters and st.session.name not in busy_sessions:
                before = self.store.manager.num_free_blocks
                self.release(st.computing)
                st.computing = None
                freed += self.store.manager.num_free_blocks - before
            if st.session.name in busy_sessions or st.waiters or st.ready is None or st.ready.table is None:
                continue
            if stale_only and st.fresh():
                continue
            before = self.store.manager.num_free_blocks
            self.release(st.ready)
            freed += self.store.manager.num_free_blocks - before
            st.ready, st.ready_hidden = None, None
            st.record = None
            self.entries_evicted += 1
        return freed

    def rebase(self, session: str) -> None:
        """After a compaction swap: entries forked from the old blocks would pin the whole old
        context, so they go (recomputed on the new blocks). The published record stays: the
        fast path keeps answering from it meanwhile."""
        for st in self.standing(session):
            for br in st.branches():
                self.release(br)
            st.computing = st.ready = st.decoding = None
            st.ready_hidden = None

    # -- answers ---------------------------------------------------------------
    def decide(self, st: Standing) -> GateDecision:
        return st.gate.decide(st.ready_logits, st.ready_hidden)

    def fork_from_entry(self, st: Standing, branch: DecodingBranch) -> None:
        """Give `branch` (an ask or decode) the entry's KV; its next token comes from the ready logits."""
        entry = st.ready
        branch.table = self.store.fork(entry.table)
        branch.base_len = entry.base_len
        branch.data_version = entry.data_version
        branch.num_computed = len(entry.prompt_ids)
        branch.first_logits = entry.first_logits

    def set_answer(self, st: Standing, text: str, path: AnswerPath, confidence: float, version: int,
                   choices: dict[str, float] | None = None) -> StandingAnswer | None:
        """Record the standing answer; returns it when it changed (what subscribers hear)."""
        previous = st.answer
        summary = st.calibration.summary
        rec = st.record if st.record is not None and st.record.data_version == version else None
        warming = None if rec is None else rec.warming_up
        figures = None if summary is None else summary.to_dict()
        if figures is not None and st.learner is not None:
            figures["learning"] = st.learner.figures()
        st.answer = StandingAnswer(st.session.name, st.spec.id, text, path, confidence, version, choices=choices,
                                   calibration=figures,
                                   warming_up=warming is not None, warming_up_reason=warming,
                                   threshold=None if rec is None else rec.threshold,
                                   threshold_source="config" if rec is None else rec.threshold_source)
        if previous is not None and previous.text == text and previous.warming_up == st.answer.warming_up:
            return None  # told again only when it changed, or stopped being a guess
        return st.answer


def warming_up(st: Standing) -> str | None:
    """Why `st`'s ready answer is a guess rather than an answer (None: it is one): the session had no data
    yet, the question's head could not read (a series head holds fewer lines than it reads: the LM decided
    alone, at the config's threshold), or its label looks back over more bars than the session holds."""
    entry, s, head = st.ready, st.session, st.gate.head
    if entry.data_version == 0:
        return "no data yet (data_version 0)"
    lines = s.lines_upto(entry.base_len)
    if head is not None and st.ready_hidden is None:
        first = (head.min_lines or head.lines) if head.kind == HeadKind.SERIES else 0
        if lines < first:
            return f"its head needs {first} lines; the session has {lines} so far"
        return "its head's inputs are not computed yet"
    label = st.spec.label
    if label is not None and lines < label.bars_needed:
        return f"its label {label.text} looks back {label.bars_needed} bars; the session has {lines} so far"
    return None


def threshold_in_force(gate: Gate, answer: str, *, head_read: bool) -> tuple[float | None, str]:
    """The gap the gate decided `answer` at (None: closed, infinite) and whose it is, as `Gate.decide` picks
    it: "auto" (live, per answer), "head" (an adapter head's calibrated threshold, when the head could read),
    or "config" (the question's own `threshold`, also for a head that could not read yet)."""
    if gate.auto:
        live = gate.choice_thresholds
        value = live.get(answer.casefold(), math.inf) if gate.choices and live is not None else gate.threshold
        source = "auto"
    elif gate.head is not None and head_read:
        value, source = gate.head.threshold, "head"
    else:
        value, source = gate.threshold, "config"
    return (float(value) if math.isfinite(value) else None), source
