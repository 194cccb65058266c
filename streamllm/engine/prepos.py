"""Pre-positioning: keep every standing question's entry at its session's newest data.

An entry is a branch holding the question's tokens on top of the session at one
data version, plus the ready distribution (logits at the decision point). After
each ingested batch the entries of that session go stale and are recomputed as idle
work. Asking a standing question then costs a gate decision (fast path) or decoding
from the entry (entry path), never the question's prefill.

    session  [prefix | data ... v7]
    entry    [prefix | data ... v7 | Question: ...<assistant>] -> ready logits @ v7

Bounded lag: an entry already computing for an older version is allowed to finish
(it is the freshest answer we will have soon); a new one starts after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from streamllm.config import QuestionSpec, normalize_question
from streamllm.engine.gate import Gate, GateDecision
from streamllm.engine.kv import KVCapacityError, KVStore
from streamllm.engine.sequence import Branch, PromptLayout, Session


@dataclass(slots=True)
class StandingAnswer:
    session: str
    question_id: str
    text: str
    path: str  # "fast" (gate fired) | "entry" (decoded from the entry)
    confidence: float  # the gate's gap
    data_version: int
    updated_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True, eq=False)
class Standing:
    """One standing question on one session, with its newest entries."""

    session: Session
    spec: QuestionSpec
    gate: Gate
    prompt_ids: list[int]
    computing: Branch | None = None  # entry being prefilled
    ready: Branch | None = None  # newest entry whose ready distribution is known
    decoding: Branch | None = None  # standing-answer decode (push questions the gate left open)
    answer: StandingAnswer | None = None
    waiters: list[Branch] = field(default_factory=list)  # asks waiting for a fresh entry
    entries_computed: int = 0
    ready_hidden: torch.Tensor | None = None  # final normed hidden state at `ready`'s decision point (heads only)

    @property
    def ready_logits(self) -> torch.Tensor | None:
        return None if self.ready is None else self.ready.first_logits

    def fresh(self) -> bool:
        return self.ready is not None and self.ready.data_version == self.session.data_version


class Prepositioner:
    """Standing questions per session, their entries and standing answers (bookkeeping only)."""

    def __init__(self, store: KVStore, layout: PromptLayout, adapter=None) -> None:
        self.store = store
        self.layout = layout
        self.adapter = adapter  # streamllm.model.adapter.Adapter: choice heads by question text and choices
        self.by_session: dict[str, dict[str, Standing]] = {}
        self.entry_tokens = 0  # idle compute spent on entries (tokens)
        self.entries_evicted = 0

    # -- registry ----------------------------------------------------------
    def register(self, session: Session, spec: QuestionSpec) -> Standing:
        questions = self.by_session.setdefault(session.name, {})
        if spec.id in questions:
            raise ValueError(f"session {session.name!r} already has a standing question {spec.id!r}")
        with self.layout.lock:  # the gate encodes choices with the shared tokenizer
            gate = Gate.for_question(spec, self.layout.tokenizer)
        if self.adapter is not None and spec.choices:
            gate.head = self.adapter.head_for(spec.text, spec.choices)
        st = Standing(session, spec, gate, self.layout.question_ids(spec.text))
        questions[spec.id] = st
        return st

    def unregister(self, session: str, question_id: str) -> None:
        st = self.by_session.get(session, {}).pop(question_id, None)
        if st is None:
            raise KeyError(f"session {session!r} has no standing question {question_id!r}")
        self._drop(st)

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
        for br in (st.computing, st.ready, st.decoding):
            self.release(br)
        st.computing = st.ready = st.decoding = None

    def find(self, session: str, query: str) -> Standing | None:
        questions = self.by_session.get(session, {})
        if query in questions:
            return questions[query]
        normalized = normalize_question(query)
        for st in questions.values():
            if st.spec.normalized_text == normalized:
                return st
        return None

    def standing(self, session: str) -> list[Standing]:
        return list(self.by_session.get(session, {}).values())

    def all(self) -> list[Standing]:
        return [st for qs in self.by_session.values() for st in qs.values()]

    # -- entries -------------------------------------------------------------
    def refresh(self) -> None:
        """Start an entry at the newest data version for every question that lacks one."""
        for st in self.all():
            s = st.session
            if not s.ready or st.fresh():
                continue
            if st.computing is not None:
                if st.computing.data_version == s.data_version or st.computing.num_computed > 0:
                    continue  # current, or part-paid for an older version: let it finish
                self.release(st.computing)  # not started: restart at the newest
                st.computing = None
            try:
                table = self.store.fork(s.table, s.version_length(s.data_version))
            except KVCapacityError:
                continue  # entries are optional work: retry when cells free up
            st.computing = Branch(
                s, st.spec.text, st.prompt_ids, 0, [], None, table=table,
                base_len=s.version_length(s.data_version), data_version=s.data_version,
                keep_logits=True, purpose="entry", standing=st,
            )

    def entry_jobs(self) -> tuple[list[Branch], list[Branch]]:
        """(entries someone is waiting for, other idle jobs: entries then answer decodes)."""
        urgent, idle = [], []
        for st in self.all():
            if st.computing is not None:
                (urgent if st.waiters else idle).append(st.computing)
        idle += [st.decoding for st in self.all() if st.decoding is not None]
        return urgent, idle

    def wants_hidden(self, job: object) -> bool:
        """An entry whose question has a head needs the hidden state of its last row."""
        return isinstance(job, Branch) and job.purpose == "entry" and job.standing.gate.head is not None

    def on_entry_ready(self, entry: Branch, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> Standing | None:
        st: Standing = entry.standing
        self.entry_tokens += entry.num_computed
        if st.computing is not entry:  # unregistered (or its session closed) meanwhile
            self.release(entry)
            return None
        entry.first_logits = logits
        self.release(st.ready)
        st.ready, st.computing = entry, None
        st.ready_hidden = None if hidden is None else hidden.clone()
        st.entries_computed += 1
        return st

    def evict_idle_entries(self, busy_sessions: set[str]) -> int:
        """Free the ready entries of sessions nobody is using now (recomputable); returns blocks freed."""
        freed = 0
        for st in self.all():
            if st.session.name in busy_sessions or st.waiters or st.ready is None or st.ready.table is None:
                continue
            before = self.store.manager.num_free_blocks
            self.release(st.ready)
            freed += self.store.manager.num_free_blocks - before
            st.ready, st.ready_hidden = None, None
            self.entries_evicted += 1
        return freed

    # -- answers ---------------------------------------------------------------
    def decide(self, st: Standing) -> GateDecision:
        return st.gate.decide(st.ready_logits, st.ready_hidden)

    def first_token(self, st: Standing, decision: GateDecision) -> int:
        """The first answer token when decoding on from the entry: the gate's choice when it fired or
        when a head chose it (a head's pick beats the LM's even unconfident), else the LM's greedy one."""
        if decision.fired or (st.gate.head is not None and st.ready_hidden is not None):
            return decision.token_id
        return int(torch.argmax(st.ready_logits))

    def fork_from_entry(self, st: Standing, kind_branch: Branch) -> None:
        """Give `kind_branch` (an ask or decode) the entry's KV and its first greedy token."""
        entry = st.ready
        kind_branch.table = self.store.fork(entry.table)
        kind_branch.base_len = entry.base_len
        kind_branch.data_version = entry.data_version
        kind_branch.num_computed = len(entry.prompt_ids)
        kind_branch.first_logits = entry.first_logits

    def set_answer(self, st: Standing, text: str, path: str, confidence: float, version: int) -> StandingAnswer | None:
        """Record the standing answer; returns it when it changed (what subscribers hear)."""
        previous = st.answer
        st.answer = StandingAnswer(st.session.name, st.spec.id, text, path, confidence, version)
        if previous is not None and previous.text == text:
            return None
        return st.answer

