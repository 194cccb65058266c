"""The batcher's policy: which sequences run in the next step, and how many tokens each.

It returns a plan and never touches tensors (vLLM v1's schedule() -> model ->
update_from_output()). Classes, served in order under one token budget per step:

  1. interactive: questions someone waits for (prefill chunks and decode tokens),
  2. ingest: prefill chunks of pushed data,
  3. idle: pre-positioning entries and standing-answer decodes, planned only in a step
     with no class 1 or 2 work (so background work never lengthens a question's step;
     it is preempted between steps, and each step it yields is counted).

Within a class, service is fair: sequences are interleaved by tenant, then by session,
and the starting point rotates every step, so a tenant with many sessions cannot
starve a tenant with one. Chunked prefill bounds how long a question waits behind an
ingest: at most one chunk; while questions run, ingest gets only a trickle of each step.
Slot assignment (`can_append` / `append`) happens here, as
nano-vllm's scheduler allocates through its block manager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from streamllm.engine.kv import BlockManager, BlockTable

INTERACTIVE, INGEST, IDLE = "interactive", "ingest", "idle"


@dataclass(slots=True, eq=False)
class PlanItem:
    kind: str  # INTERACTIVE | INGEST | IDLE
    owner: object  # the Branch or Session the tokens belong to
    table: BlockTable
    token_ids: list[int]
    start_pos: int
    want_logits: str


@dataclass(slots=True)
class Plan:
    items: list[PlanItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)

    def tokens_of(self, kind: str) -> int:
        return sum(len(i.token_ids) for i in self.items if i.kind == kind)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(slots=True)
class SchedulerConfig:
    step_tokens: int = 256  # token budget per forward (decode tokens + prefill chunks)
    chunk_tokens: int = 128  # largest prefill chunk of one sequence in one step
    # Ingest riding along in a step that serves questions. On a CPU every prefill token costs
    # about as much as it does alone, so a full chunk beside each decode step would multiply a
    # question's latency; a trickle keeps ingest moving while questions run.
    ingest_tokens_with_questions: int = 16
    # A question that arrives waits for the step in flight. While questions keep coming (one
    # was served within busy_window_s), background steps shrink to busy_step_tokens so that
    # wait stays short; when questions stop, background work gets full steps again.
    busy_step_tokens: int = 32
    busy_window_s: float = 2.0


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {INTERACTIVE: 0, INGEST: 0, IDLE: 0})
    idle_preempted: int = 0  # steps in which idle work was ready but yielded to class 1/2
    blocked: int = 0  # sequences skipped for lack of cells


def tenant_of(session_name: str) -> str:
    """Sessions of tenant t are named "t/..." by the server; bare names form one tenant."""
    head, sep, _ = session_name.partition("/")
    return head if sep else ""


def fair_order(items: list, session_name: Callable[[object], str], turn: int) -> list:
    """Interleave items by tenant, then by session; rotate the starting tenant/session by `turn`."""
    tenants: dict[str, dict[str, list]] = {}
    for item in items:
        name = session_name(item)
        tenants.setdefault(tenant_of(name), {}).setdefault(name, []).append(item)
    queues: list[list] = []
    for sessions in _rotate(list(tenants.values()), turn):
        queues.append(_interleave(_rotate(list(sessions.values()), turn)))
    return _interleave(queues)


def _rotate(seq: list, turn: int) -> list:
    if not seq:
        return seq
    k = turn % len(seq)
    return seq[k:] + seq[:k]


def _interleave(queues: list[list]) -> list:
    out, depth = [], max((len(q) for q in queues), default=0)
    for i in range(depth):
        out.extend(q[i] for q in queues if i < len(q))
    return out


class Scheduler:
    def __init__(self, manager: BlockManager, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self._turn = 0
        self._clock = clock
        self._last_question = float("-inf")

    def _take(self, plan: Plan, kind: str, owner, table: BlockTable, ids: list[int], start: int, want: str,
              budget: int) -> int:
        """Plan up to one chunk of `ids` for `owner`; returns the tokens planned (0 if no room)."""
        if table.num_tokens != start:
            raise AssertionError(f"{kind} work starts at {start} but its table holds {table.num_tokens} slots")
        n = min(len(ids), self.config.chunk_tokens, budget)
        if n <= 0:
            return 0
        if not self.manager.can_append(table, n):
            self.stats.blocked += 1
            return 0
        self.manager.append(table, n)
        plan.items.append(PlanItem(kind, owner, table, ids[:n], start, want if n == len(ids) else "none"))
        return n

    def schedule(self, interactive: list, sessions: list, idle: list | None = None) -> Plan:
        """interactive, idle: branches (table, pending_ids, next_pos, session); sessions: Session objects."""
        plan = Plan()
        budget = self.config.step_tokens
        turn = self._turn
        self._turn += 1
        for br in fair_order(interactive, lambda b: b.session.name, turn):
            if budget <= 0:
                break
            budget -= self._take(plan, INTERACTIVE, br, br.table, br.pending_ids, br.next_pos, "last", budget)
        now = self._clock()
        if plan:
            self._last_question = now
            budget = min(budget, self.config.ingest_tokens_with_questions)
        elif now - self._last_question < self.config.busy_window_s:
            budget = min(budget, self.config.busy_step_tokens)
        ready = [s for s in sessions if s.pending_tokens > 0 and not s.closing]
        for s in fair_order(ready, lambda s: s.name, turn):
            if budget <= 0:
                break
            ids = s.token_ids[s.num_computed :]
            budget -= self._take(plan, INGEST, s, s.table, ids, s.num_computed, "none", budget)
        if idle and plan:
            self.stats.idle_preempted += 1
        elif idle:
            for job in fair_order(idle, lambda b: b.session.name, turn):
                if budget <= 0:
                    break
                want = getattr(job, "want_logits", "last")  # a compaction copy needs no logits
                budget -= self._take(plan, IDLE, job, job.table, job.pending_ids, job.next_pos, want, budget)
        if plan:
            self.stats.steps += 1
            for item in plan.items:
                self.stats.tokens[item.kind] += len(item.token_ids)
        return plan
