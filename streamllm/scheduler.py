"""The batcher's policy: which sequences run in the next step, and how many tokens each.

It returns a plan and never touches tensors (vLLM v1's schedule() -> model ->
update_from_output()). Classes, served in order under one token budget per step:
  1. interactive questions (prefill chunks and decode tokens of branches),
  2. ingest (prefill chunks of pushed data, round-robin over sessions),
  3. idle work (pre-positioning), only when 1 and 2 left budget.
Slot assignment (`can_append` / `append`) happens here, as nano-vllm's scheduler
allocates through its block manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamllm.kv import BlockManager, BlockTable

INTERACTIVE, INGEST, IDLE = "interactive", "ingest", "idle"


@dataclass(slots=True, eq=False)
class PlanItem:
    kind: str  # INTERACTIVE | INGEST | IDLE
    owner: object  # the Branch or Session (or idle job) the tokens belong to
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

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(slots=True)
class SchedulerConfig:
    step_tokens: int = 256  # token budget per forward (decode tokens + prefill chunks)
    chunk_tokens: int = 128  # largest prefill chunk of one sequence in one step


class Scheduler:
    def __init__(self, manager: BlockManager, config: SchedulerConfig | None = None) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        self._ingest_cursor = 0

    def _take(self, plan: Plan, kind: str, owner, table: BlockTable, ids: list[int], start: int, want: str, budget: int) -> int:
        """Plan up to one chunk of `ids` for `owner`; returns the tokens planned (0 if no room)."""
        if table.num_tokens != start:
            raise AssertionError(f"{kind} work starts at {start} but its table holds {table.num_tokens} slots")
        n = min(len(ids), self.config.chunk_tokens, budget)
        if n <= 0 or not self.manager.can_append(table, n):
            return 0
        self.manager.append(table, n)
        plan.items.append(PlanItem(kind, owner, table, ids[:n], start, want if n == len(ids) else "none"))
        return n

    def schedule(self, branches: list, sessions: list, idle_jobs: list | None = None) -> Plan:
        """branches: running Branch objects (forked); sessions: Session objects with pending tokens."""
        plan = Plan()
        budget = self.config.step_tokens
        for br in branches:
            if budget <= 0:
                break
            budget -= self._take(plan, INTERACTIVE, br, br.table, br.pending_ids, br.next_pos, "last", budget)
        ready = [s for s in sessions if s.pending_tokens > 0 and not s.closing]
        if ready:
            start = self._ingest_cursor % len(ready)
            for s in ready[start:] + ready[:start]:
                if budget <= 0:
                    break
                ids = s.token_ids[s.num_computed :]
                budget -= self._take(plan, INGEST, s, s.table, ids, s.num_computed, "none", budget)
            self._ingest_cursor += 1
        # Idle work never rides along with a question: it would lengthen the question's step.
        if any(item.kind == INTERACTIVE for item in plan.items):
            return plan
        for job in idle_jobs or []:
            if budget <= 0:
                break
            budget -= self._take(plan, IDLE, job, job.table, job.pending_ids, job.next_pos, "last", budget)
        return plan
