"""The batcher's policy: which sequences run in the next step, and how many tokens each.

It returns a plan and never touches tensors (vLLM v1's schedule() -> model ->
update_from_output()). Three classes share one token budget per step:

  1. interactive: questions someone waits for (prefill chunks, decode tokens),
  2. ingest: prefill chunks of pushed data (and compaction copies of sessions at budget),
  3. background: pre-positioning entries, standing-answer decodes, compaction copies.

Guarantees (proven by tests/test_scheduler.py without a model):

  - interactive work is planned first, but whenever ingest or background work is
    pending, each gets at least its floor (`ingest_floor`, `background_floor` tokens)
    in every step without questions and in at least every second step with them:
    neither is ever starved, under any load of questions;
  - a step holding questions runs them alone when the step before it did not (a
    question arriving while ingest runs gets a step of its own: on a CPU every token
    beside it lengthens the step it waits for), else beside the floors owed; while
    questions run, ingest and background get only their floors, and while questions keep coming
    (one within `busy_window_s`) every step a question would wait for is latency-bound (with cut-ins,
    only steps holding questions and the floors' step after one: a question arriving during a step of
    ingest alone cuts into it, below; without, every step): its ingest and background work
    is cut so that its predicted cost stays within `step_latency_ms` (or twice the step's
    fixed cost and one item's, where that is more: at most half a step is overhead, so ingest
    keeps moving on a slow machine), so a new question waits at most one short step. A question itself is never cut (up to `chunk_tokens`): each cut
    would cost it a step, and on a machine whose fixed cost alone is over the target it
    would move one token a step. Until the cost model has seen enough steps (or with
    `step_latency_ms=None`) a busy step holds `busy_step_tokens`;
  - latency-bound, a question's step is always its own: the floors a question step skipped
    get the next step to themselves (`deferred`), cut to the target like any step without
    questions (one token each at least), so questions asked back to back alternate with
    short floor steps and never ride beside 16 + 16 tokens of floors;
  - quiet steps (no question within `busy_window_s`) can be bounded too (`quiet_step_latency_ms`,
    off by default: long quiet steps refresh standing answers faster);
  - a question arriving while a step without questions runs cuts in between two of its layers
    (`cut_in`, run by EngineCore._cut_in): a step of its own, while the cut-ins of that step have taken
    at most `cut_in_share` of its own time so far, plus one latency target (under a storm of questions
    the two alternate, and ingest keeps its share of the core);
  - with no questions, background gets at least `background_share` of the step (standing
    answers keep up with a feed that saturates ingest), ingest the rest, and background
    whatever ingest leaves.

A step's cost is predicted by `StepCost` (engine/stepcost.py), fitted online from the
step times the core measures (`Scheduler.observe`); injected, it makes tests deterministic.

Within a class, service is fair: sequences are interleaved by tenant, then by session,
and the starting point rotates every step. Slot assignment (`can_append` / `append`)
happens here, as nano-vllm's scheduler allocates through its block manager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from streamllm.engine.kv import BlockManager
from streamllm.engine.sequence import Logits, SchedClass, Sequence
from streamllm.engine.stepcost import StepCost, StepShape

INTERACTIVE, INGEST, BACKGROUND = SchedClass.INTERACTIVE, SchedClass.INGEST, SchedClass.BACKGROUND
CLASSES = tuple(SchedClass)


@dataclass(slots=True, eq=False)
class PlanItem:
    seq: Sequence
    sched_class: SchedClass
    token_ids: list[int]
    start_pos: int
    want_logits: Logits  # the sequence's own (LAST) when this chunk completes its pending tokens, else NONE


@dataclass(slots=True)
class Plan:
    items: list[PlanItem] = field(default_factory=list)
    predicted_ms: float | None = None  # the cost model's prediction, once it is ready

    @property
    def shape(self) -> StepShape:
        return StepShape.of((i.start_pos, len(i.token_ids)) for i in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)

    def tokens_of(self, sched_class: SchedClass) -> int:
        return sum(len(i.token_ids) for i in self.items if i.sched_class == sched_class)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    step_tokens: int = 256  # token budget per forward (decode tokens + prefill chunks)
    chunk_tokens: int = 128  # largest prefill chunk of one sequence in one step
    ingest_floor: int = 16  # tokens of ingest in every step that has ingest pending
    background_floor: int = 16  # tokens of background work in every step that has some
    # Without questions, background work (standing answers!) gets at least this share of the
    # step, so standing answers keep up with a feed that saturates ingest.
    background_share: float = 0.25
    busy_step_tokens: int = 48  # step budget while questions keep coming, until the cost model is ready
    busy_window_s: float = 2.0
    # While questions keep coming, a step's predicted wall time stays within this (its floors
    # excepted), so a new question waits at most this long for the step in flight. 40 ms: the
    # goal is a question under load within 2x its idle latency, ~90 ms for a cold ask on a
    # 2-core CPU; one step's wait plus the floors beside the question's own step must fit
    # in the other 90. On a GPU steps are far cheaper and `step_tokens` binds first.
    # None: fixed budgets (`busy_step_tokens`).
    step_latency_ms: float | None = 40.0
    # The same bound when no question came within `busy_window_s` (the first question after a quiet
    # spell waits for one such step). None, the default: quiet steps hold `step_tokens`, because each
    # step pays its fixed cost once and standing answers refresh faster in long steps (measured: a bar
    # pushed to 4 sessions x 4 standing questions was answered everywhere in 1,039 ms p50 unbounded,
    # 1,272 ms with 150 and 1,786 ms with 60).
    quiet_step_latency_ms: float | None = None
    # Questions that arrive while a step of ingest or background work runs cut in between two of its
    # layers: their own step runs then, and the step in flight finishes after (EngineCore._cut_in). They
    # cut in while those of this step took at most this share of its own time so far, plus one
    # `step_latency_ms`: 2.0, under a storm of questions each waits for about half a question's step of
    # ingest and ingest keeps a third of the core. 0: a question waits for the step in flight.
    cut_in_share: float = 2.0

    def __post_init__(self) -> None:
        share = self.cut_in_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not share >= 0:
            raise ValueError(f"SchedulerConfig.cut_in_share must be a number >= 0, got {share!r}")
        for name in ("step_latency_ms", "quiet_step_latency_ms"):
            ms = getattr(self, name)
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float) or not ms > 0):
                raise ValueError(f"SchedulerConfig.{name} must be None or a number of ms > 0, got {ms!r}")


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    tokens: dict[SchedClass, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    floor_steps: dict[SchedClass, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))  # steps served at floor
    blocked: int = 0  # sequences skipped for lack of cells
    latency_bound_steps: int = 0  # steps whose work was cut to the latency target
    cut_in_steps: int = 0  # question steps run between two layers of another step (`cut_in`)
    budget_last: int = 0  # the last step's token budget


def fair_order(items: list, owner: Callable[[object], tuple[str, str]], turn: int) -> list:
    """Interleave items by tenant, then by session; rotate the starting tenant, session and item by `turn`.

    owner(item) -> (tenant, session name): the tenant is the session's field, never read from its name."""
    tenants: dict[str, dict[str, list]] = {}
    for item in items:
        tenant, name = owner(item)
        tenants.setdefault(tenant, {}).setdefault(name, []).append(item)
    queues: list[list] = []
    for sessions in _rotate(list(tenants.values()), turn):
        # Rotate within a session too: its standing questions' entries take turns, so the first
        # registered one cannot keep the background floor to itself while data keeps arriving.
        queues.append(_interleave(_rotate([_rotate(q, turn) for q in sessions.values()], turn)))
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
                 clock: Callable[[], float] = time.monotonic, cost: StepCost | None = None) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self.cost = cost or StepCost()
        self._turn = 0
        self._clock = clock
        self._last_question = float("-inf")
        self._alone_last = False  # the last step held questions alone (the floors it skipped are owed next)
        self._ms_left: float | None = None  # the latency-bound step's time not yet planned; None: unbounded

    def observe(self, plan: Plan, ms: float) -> None:
        """The measured wall time of an executed plan (the core calls this after every step)."""
        self.cost.observe(plan.shape, ms)

    def schedule(self, sequences: list[Sequence]) -> Plan:
        """Plan the next step over every sequence with pending tokens (any class)."""
        by_class: dict[SchedClass, list[Sequence]] = {c: [] for c in CLASSES}
        for seq in sequences:
            if seq.pending_ids:
                by_class[seq.sched_class].append(seq)
        cfg = self.config
        now = self._clock()
        questions = bool(by_class[INTERACTIVE])
        if questions:
            self._last_question = now
        busy = questions or now - self._last_question < cfg.busy_window_s
        # A step without questions is metered only where a question arriving meanwhile would wait for it:
        # with cut-ins one runs between two of its layers instead, so it is planned as a quiet step (long
        # steps pay their fixed cost once: ingest and standing answers move faster).
        metered = busy and (questions or not cfg.cut_in_share)
        latency = cfg.step_latency_ms if metered else cfg.quiet_step_latency_ms
        target = latency if latency is not None and self.cost.ready else None
        if target is not None:  # a step whose overhead leaves no room: at most half a step is overhead,
            # its first item's included (a chunk's own attention kernels in every layer cost that much however
            # few its tokens: below it, a line is chopped into many steps that each pay it again)
            target = max(target, 2 * (self.cost.fixed_ms + self.cost.item_ms(0, 0)))
        # Latency-bound, a question's step is always its own; right after one, ingest and background get
        # a short step of their floors before the next question (so they move at least every second step).
        pending_floors = bool(by_class[INGEST] or by_class[BACKGROUND])
        deferred = target is not None and questions and self._alone_last and pending_floors
        if deferred:
            by_class = {**by_class, INTERACTIVE: []}
            questions = False
        if target is None:
            budget = cfg.busy_step_tokens if metered else cfg.step_tokens
        else:
            budget = self._tokens_within(target, by_class)
        floor_ingest = cfg.ingest_floor if by_class[INGEST] else 0
        floor_bg = cfg.background_floor if by_class[BACKGROUND] else 0
        if floor_bg and not questions:
            floor_bg = max(floor_bg, int(cfg.background_share * budget))
        if target is not None and not questions:
            # A question arriving now waits for this very step: its floors fit the target too (half the
            # budget each at most; only one token of each is owed past the meter, so neither stops moving).
            cap = max(1, budget // 2)
            floor_ingest, floor_bg = min(floor_ingest, cap), min(floor_bg, cap)
        # A question's step runs alone unless the step before it did: floors beside a question lengthen the
        # very step someone waits for (measured: a 19-token ask's forward doubles with 16 + 16 tokens beside
        # it on a CPU), while ingest and background still move at least every second step. Latency-bound,
        # the floors it owes went to a step of their own instead (`deferred`).
        owed = (floor_ingest, floor_bg)
        alone = questions and (target is not None or not self._alone_last) and pending_floors
        if alone:
            floor_ingest = floor_bg = 0
        turn, self._turn = self._turn, self._turn + 1
        plan = Plan()
        # Questions are never cut by the meter: a cut question pays a second step (and on a machine whose
        # fixed cost alone is over the target, one token a step). The meter chops ingest and background
        # work while questions are likely, so the next one waits at most one short step; beside a
        # question those get only their floors anyway.
        self._ms_left = None
        bg_floor_ms = self._floor_ms(by_class[BACKGROUND], floor_bg)
        interactive = max(budget - floor_ingest - floor_bg, 1) if target is None else cfg.step_tokens
        used = self._fill(plan, INTERACTIVE, by_class[INTERACTIVE], interactive, turn)
        if alone and not used:  # no question could be planned (no cells): the step is the floors'
            alone, (floor_ingest, floor_bg) = False, owed
            bg_floor_ms = self._floor_ms(by_class[BACKGROUND], floor_bg)
        self._alone_last = alone
        # Owed whatever the meter says: the floors beside questions; in a metered step one token per
        # class (the floors then only reserve the background's share of the time, `bg_floor_ms`).
        owe_ingest, owe_bg = floor_ingest, floor_bg
        if target is not None and not questions:
            self._ms_left = target - self.cost.fixed_ms
            owe_ingest, owe_bg = min(floor_ingest, 1), min(floor_bg, 1)
        left = budget - used
        # Ingest: its floor beside questions, else everything but the background floor.
        ingest_budget = floor_ingest if questions else max(left - floor_bg, floor_ingest)
        self._spend(bg_floor_ms)
        used = self._fill(plan, INGEST, by_class[INGEST], min(ingest_budget, max(left, floor_ingest)), turn,
                          floor=owe_ingest)
        left = max(left - used, 0)
        bg_budget = max(left, floor_bg) if not questions else floor_bg
        self._spend(-bg_floor_ms)
        self._fill(plan, BACKGROUND, by_class[BACKGROUND], bg_budget, turn, floor=owe_bg)
        self._ms_left = None
        if deferred and not plan:  # the floors could not run (no cells): the question does not wait for them
            return self.schedule(sequences)

        if plan:
            if self.cost.ready:
                plan.predicted_ms = self.cost.predict(plan.shape)
            self.stats.steps += 1
            self.stats.budget_last = budget
            self.stats.latency_bound_steps += target is not None
            for c in CLASSES:
                n = plan.tokens_of(c)
                self.stats.tokens[c] += n
                if by_class[c] and n and n <= {INTERACTIVE: 0, INGEST: floor_ingest, BACKGROUND: floor_bg}[c]:
                    self.stats.floor_steps[c] += 1
        return plan

    def cut_in(self, questions: list[Sequence]) -> Plan:
        """A step of `questions` alone, planned while another step runs: the core runs it between two of
        that step's layers, so none of them may be in that step. Questions are never cut (up to
        `chunk_tokens` each, `step_tokens` in all); the step in flight keeps its plan and its floors."""
        plan = Plan()
        questions = [q for q in questions if q.pending_ids]
        if not questions:
            return plan
        self._last_question = self._clock()
        self._fill(plan, INTERACTIVE, questions, self.config.step_tokens, self._turn)
        if plan:
            if self.cost.ready:
                plan.predicted_ms = self.cost.predict(plan.shape)
            self.stats.steps += 1
            self.stats.cut_in_steps += 1
            self.stats.tokens[INTERACTIVE] += plan.num_tokens
        return plan

    def _tokens_within(self, target_ms: float, by_class: dict[SchedClass, list[Sequence]]) -> int:
        """The step's token budget: what the pending work, taken class by class, fits in target_ms
        (at least 1, at most `step_tokens`); beside questions the floors come on top. The meter in
        `_take` then holds the plan to the target exactly."""
        cfg = self.config
        ms, tokens = target_ms - self.cost.fixed_ms, 0
        for c in CLASSES:
            for seq in by_class[c]:
                want = min(len(seq.pending_ids), cfg.chunk_tokens, cfg.step_tokens - tokens)
                n = self.cost.affordable(seq.next_pos, want, ms)
                tokens += n
                ms -= self.cost.item_ms(seq.next_pos, n)
                if n < want or tokens >= cfg.step_tokens:
                    break
            else:
                continue
            break
        if by_class[INTERACTIVE]:
            tokens += (cfg.ingest_floor if by_class[INGEST] else 0) + (cfg.background_floor if by_class[BACKGROUND] else 0)
        return max(tokens, 1)

    def _floor_ms(self, seqs: list[Sequence], floor: int) -> float:
        """The time a class's floor will take in this step (estimated on its first sequence)."""
        if not floor or not seqs:
            return 0.0
        return self.cost.item_ms(seqs[0].next_pos, min(floor, len(seqs[0].pending_ids), self.config.chunk_tokens))

    def _spend(self, ms: float) -> None:
        if self._ms_left is not None:
            self._ms_left -= ms

    def _fill(self, plan: Plan, sched_class: SchedClass, seqs: list[Sequence], budget: int, turn: int,
              floor: int = 0) -> int:
        """Plan up to `budget` tokens of one class; its first `floor` tokens are owed, whatever the meter says."""
        used = 0
        for seq in fair_order(seqs, lambda s: (s.tenant, s.session_name), turn):
            if budget - used <= 0:
                break
            used += self._take(plan, sched_class, seq, budget - used, owed=max(floor - used, 0))
        return used

    def _take(self, plan: Plan, sched_class: SchedClass, seq: Sequence, budget: int, owed: int = 0) -> int:
        """Plan up to one chunk of `seq`'s pending tokens; returns the tokens planned (0 if no room).

        In a latency-bound step the chunk is cut to what the step's time left affords, except
        the `owed` tokens of a floor, and except the step's first item, which gets at least one."""
        ids, start = seq.pending_ids, seq.next_pos
        if seq.table.num_tokens != start:
            raise AssertionError(f"{sched_class} work starts at {start} but its table holds {seq.table.num_tokens} slots")
        n = min(len(ids), self.config.chunk_tokens, budget)
        if self._ms_left is not None and n > 0:
            n = max(min(n, owed), self.cost.affordable(start, n, self._ms_left), 0 if plan.items else 1)
        if n <= 0:
            return 0
        if not self.manager.can_append(seq.table, n):
            self.stats.blocked += 1
            return 0
        self.manager.append(seq.table, n)
        if self._ms_left is not None:
            self._ms_left -= self.cost.item_ms(start, n)
        want = seq.want_logits if n == len(ids) else Logits.NONE
        plan.items.append(PlanItem(seq, sched_class, ids[:n], start, want))
        return n
