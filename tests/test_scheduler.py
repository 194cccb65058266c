"""The batcher's policy without a model: a fake runner just marks planned tokens computed.

These tests are the proof of the scheduler's guarantees (docstring of engine/scheduler.py):
questions first, ingest and background work never starved, short steps while questions
keep coming, fairness across tenants and sessions.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from streamllm.engine.compaction import CompactionCopy
from streamllm.engine.kv import BlockManager, BlockTable
from streamllm.engine.scheduler import Plan, Scheduler, SchedulerConfig, fair_order
from streamllm.engine.sequence import (
    AskBranch,
    Branch,
    DecodeBranch,
    EntryBranch,
    SchedClass,
    Session,
)
from streamllm.engine.stepcost import StepCost, StepShape

INTERACTIVE, INGEST, BACKGROUND = SchedClass.INTERACTIVE, SchedClass.INGEST, SchedClass.BACKGROUND
ASK, ENTRY, DECODE = AskBranch, EntryBranch, DecodeBranch


def session(m: BlockManager, name: str, pending: int, prefix: int = 4, max_context: int = 1 << 20,
            tenant: str = "") -> Session:
    t = BlockTable()
    m.reserve(t, min(prefix + pending + 64, max_context))
    s = Session(name, "sys", list(range(prefix)), max_context, t, tenant)
    if pending:
        s.append_batch([list(range(pending))], 0.0)
    return s


class FakeStanding:
    def __init__(self, waiters: int = 0) -> None:
        self.waiters = [object()] * waiters


def branch(s: Session, n_prompt: int, kind: type[Branch] = ASK, waiters: int = 0) -> Branch:
    st = FakeStanding(waiters) if kind is not ASK else None
    br = kind(s, "q", list(range(n_prompt)), standing=st)
    br.table = BlockTable()
    return br


def run_fake(plan: Plan) -> None:
    """What the runner + core update would do, minus the model."""
    for item in plan.items:
        if isinstance(item.seq, Session):
            item.seq.advance(len(item.token_ids))
        else:
            item.seq.num_computed += len(item.token_ids)


def test_classes_follow_from_the_sequence():
    m = BlockManager(64, 16)
    s = session(m, "a", 10)
    assert s.sched_class == INGEST
    assert branch(s, 4).sched_class == INTERACTIVE
    assert branch(s, 4, ENTRY).sched_class == BACKGROUND
    assert branch(s, 4, ENTRY, waiters=1).sched_class == INTERACTIVE  # someone waits for this entry
    assert branch(s, 4, DECODE).sched_class == BACKGROUND


def test_questions_first_but_ingest_and_background_get_their_floor_every_second_step():
    m = BlockManager(4096, 16)
    cfg = SchedulerConfig(step_tokens=128, chunk_tokens=64, ingest_floor=16, background_floor=16)
    sched = Scheduler(m, cfg)
    s = session(m, "a", 5000)
    entry = branch(s, 40, ENTRY)
    for i in range(30):  # a steady stream of questions, each bigger than the whole budget
        asks = [branch(s, 200) for _ in range(3)]
        plan = sched.schedule([*asks, s, entry])
        assert plan.items[0].sched_class == INTERACTIVE
        if i % 2 == 0:  # the first question step runs alone, the next carries the floors it owes
            assert plan.tokens_of(INGEST) == plan.tokens_of(BACKGROUND) == 0
        else:
            assert plan.tokens_of(INGEST) == 16, "ingest starved by questions"
            assert plan.tokens_of(BACKGROUND) == min(16, len(entry.pending_ids)) or not entry.pending_ids
        assert plan.num_tokens <= cfg.busy_step_tokens + cfg.ingest_floor + cfg.background_floor
        run_fake(plan)
    assert entry.num_computed == 40  # the entry finished under a steady question load


def test_a_question_arriving_during_ingest_gets_a_step_of_its_own():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=128, chunk_tokens=64, ingest_floor=16, background_floor=16))
    s = session(m, "a", 5000)
    entry = branch(s, 40, ENTRY)
    run_fake(sched.schedule([s, entry]))  # ingest and pre-positioning run ...
    ask = branch(s, 19)  # ... a question arrives: nothing shares its step
    plan = sched.schedule([ask, s, entry])
    assert [i.seq for i in plan.items] == [ask] and not ask.pending_ids[19:]
    run_fake(plan)
    m.free(ask.table)
    run_fake(sched.schedule([s, entry]))
    plan = sched.schedule([branch(s, 19), s, entry])  # the next one, after a step without questions: alone too
    assert plan.tokens_of(INGEST) == plan.tokens_of(BACKGROUND) == 0


def test_without_questions_ingest_leads_and_background_keeps_its_share():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=128, chunk_tokens=128, background_floor=16,
                                         background_share=0.25))
    s = session(m, "a", 5000)
    entry = branch(s, 40, ENTRY)
    plan = sched.schedule([s, entry])
    assert plan.tokens_of(INGEST) == 96 and plan.tokens_of(BACKGROUND) == 32


@pytest.mark.parametrize("cut_in_share", [0.0, 2.0])
def test_busy_window_shrinks_steps_then_quiet_restores_them(cut_in_share):
    m = BlockManager(1024, 16)
    now = [100.0]
    sched = Scheduler(m, SchedulerConfig(step_tokens=256, chunk_tokens=128, busy_step_tokens=48,
                                         busy_window_s=2.0, ingest_floor=16, background_floor=16,
                                         cut_in_share=cut_in_share),
                      clock=lambda: now[0])
    s = session(m, "a", 5000)

    def step(*extra):
        plan = sched.schedule([s, *extra])
        run_fake(plan)
        return plan

    assert step().num_tokens == 128  # nobody asked yet: a full chunk
    plan = step(branch(s, 4))
    assert plan.tokens_of(INTERACTIVE) == 4 and plan.tokens_of(INGEST) == 0  # a question's step of its own
    now[0] += 1.0
    # A question was just served: without cut-ins, short steps (the next question waits for one); with them
    # a whole chunk (the next question runs between two of its layers)
    assert step().tokens_of(INGEST) == (128 if cut_in_share else 48)
    if cut_in_share:
        plan = step(branch(s, 4))  # a question pending when the step is planned still gets its own
        assert plan.tokens_of(INTERACTIVE) == 4 and plan.tokens_of(INGEST) == 0
    now[0] += 1.5
    assert step().tokens_of(INGEST) == 128  # quiet again


def test_partial_chunks_ask_for_no_logits():
    m = BlockManager(64, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=16, chunk_tokens=16, busy_step_tokens=16))
    s = session(m, "a", 0)
    ask = branch(s, 40)
    first = sched.schedule([ask])
    assert first.items[0].want_logits == "none"
    run_fake(first)
    run_fake(sched.schedule([ask]))
    last = sched.schedule([ask])
    assert len(last.items[0].token_ids) == 8 and last.items[0].want_logits == "last"


def test_session_at_budget_waits_and_its_compaction_copy_becomes_ingest():
    m = BlockManager(256, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=64, chunk_tokens=64))
    s = session(m, "a", 0, max_context=128)
    s.append_batch([list(range(10))] * 20, 0.0)  # 200 data tokens: more than the budget holds
    while s.num_computed < s.max_context:
        run_fake(sched.schedule([s]))
    assert s.num_computed == 128 and s.at_budget and not s.pending_ids  # nothing more fits
    copy = CompactionCopy(s, cut=s.line_ends[8])
    assert copy.sched_class == INGEST  # the session's only way forward
    plan = sched.schedule([s, copy])
    assert [i.seq for i in plan.items] == [copy]


def test_fair_across_sessions_and_tenants():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=32, chunk_tokens=32, busy_window_s=0))
    many = [session(m, f"alice/s{i}", 10_000, tenant="alice") for i in range(5)]
    one = session(m, "bob/s", 10_000, tenant="bob")
    served = {s.name: 0 for s in [*many, one]}
    for _ in range(40):
        plan = sched.schedule([*many, one])
        for item in plan.items:
            served[item.seq.session_name] += len(item.token_ids)
        run_fake(plan)
    assert served["bob/s"] == sum(v for k, v in served.items() if k.startswith("alice/"))
    alice = [v for k, v in served.items() if k.startswith("alice/")]
    assert max(alice) - min(alice) <= 32


def test_fair_order_interleaves_tenants_then_sessions():
    class B:
        def __init__(self, tenant, name):
            self.tenant, self.name = tenant, name

    items = [B("a", "a/x"), B("a", "a/x"), B("a", "a/y"), B("b", "b/z")]
    order = [b.name for b in fair_order(items, lambda b: (b.tenant, b.name), 0)]
    assert order[:2] == ["a/x", "b/z"] and sorted(order) == sorted(b.name for b in items)


def test_no_cells_skips_a_sequence_without_breaking_the_plan():
    m = BlockManager(7, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=256, chunk_tokens=256))
    s = session(m, "a", 40)  # reserves all 7 blocks
    ask = branch(s, 10)  # needs a free block: none left
    plan = sched.schedule([ask, s])
    assert [i.sched_class for i in plan.items] == [INGEST] and sched.stats.blocked == 1
    m.check_integrity([s.table, ask.table])


def test_random_loads_never_starve_a_class():
    """Property: under any mix, every class with pending work gets tokens in every step without
    questions, and in at least one of any two steps in a row."""
    rng = random.Random(7)
    m = BlockManager(1 << 14, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=96, chunk_tokens=48))
    sessions = [session(m, f"t{i % 3}/s{i}", 20_000) for i in range(6)]
    starved = {INGEST: 0, BACKGROUND: 0}  # steps in a row a class with work got nothing
    for _ in range(200):
        asks = [branch(rng.choice(sessions), rng.randint(1, 120)) for _ in range(rng.randint(0, 4))]
        bg = [branch(rng.choice(sessions), rng.randint(1, 60), rng.choice([ENTRY, DECODE]))
              for _ in range(rng.randint(0, 3))]
        plan = sched.schedule([*asks, *sessions, *bg])
        for c, pending in ((INGEST, True), (BACKGROUND, bool(bg))):
            starved[c] = starved[c] + 1 if pending and not plan.tokens_of(c) else 0
            assert starved[c] <= (1 if asks else 0), f"{c} starved {starved[c]} steps in a row"
        if asks:
            assert plan.tokens_of(INTERACTIVE) > 0
        run_fake(plan)
        for br in asks + bg:
            m.free(br.table)


def test_a_sessions_entries_take_turns_under_a_steady_feed():
    """Found live: with ingest arriving every step, the first standing question's entry took the
    whole background floor forever and the others stayed at version 1. Every entry must progress."""
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=64, chunk_tokens=64, background_floor=16))
    s = session(m, "a", 20_000)
    entries = [branch(s, 40, ENTRY) for _ in range(3)]
    for _ in range(12):
        if not entries[0].pending_ids:  # a new version arrived: the first question's entry starts again
            entries[0] = branch(s, 40, ENTRY)
        run_fake(sched.schedule([s, *entries]))
    assert all(e.num_computed > 0 for e in entries[1:])


def test_the_tenant_is_the_sessions_field_not_a_prefix_of_its_name():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=32, chunk_tokens=32, busy_window_s=0))
    many = [session(m, f"s{i}", 10_000, tenant="alice") for i in range(5)]  # names say nothing of tenants
    one = session(m, "bob/s", 10_000)  # a slash in a name is not a tenant: "" like any session told none
    assert one.tenant == "" and one.info().tenant == "" and many[0].info().tenant == "alice"
    one.tenant = "bob"
    served = {s.name: 0 for s in [*many, one]}
    for _ in range(40):
        plan = sched.schedule([*many, one])
        for item in plan.items:
            served[item.seq.session_name] += len(item.token_ids)
        run_fake(plan)
    assert served["bob/s"] == sum(v for k, v in served.items() if k != "bob/s")


# -- the latency-bound step: a synthetic machine whose step time is known exactly ---------------

def machine(fixed: float, item: float, token: float, kpair: float):
    """A synthetic step time: what the fake runner 'measures' for a plan (no model, no clock)."""
    return lambda shape: fixed + item * shape.items + token * shape.tokens + kpair * shape.pairs / 1000


def test_step_cost_recovers_a_machine_from_its_steps():
    truth = machine(6.0, 1.5, 0.4, 0.05)
    cost = StepCost()
    rng = random.Random(3)
    for _ in range(40):
        chunks = [(rng.randint(0, 4000), rng.randint(1, 128)) for _ in range(rng.randint(1, 4))]
        assert not cost.ready or cost.steps >= cost.min_steps
        cost.observe(StepShape.of(chunks), truth(StepShape.of(chunks)))
    assert cost.ready
    for got, want in zip(cost.coef, (6.0, 1.5, 0.4, 0.05), strict=True):
        assert abs(got - want) < 0.02 * want + 1e-3, (cost.coef, want)


def heavy_ingest(m: BlockManager, cfg: SchedulerConfig, cost: StepCost, truth):
    """A session with a long backlog and a standing entry; a question every second. Returns a
    step() that plans, 'runs' the plan on the synthetic machine, advances the clock and feeds
    the measured time back, and the scheduler."""
    now = [0.0]
    sched = Scheduler(m, cfg, clock=lambda: now[0], cost=cost)
    s = session(m, "a", 50_000, prefix=600)

    def step(*extra):
        plan = sched.schedule([*extra, s])
        ms = truth(plan.shape)
        run_fake(plan)
        sched.observe(plan, ms)
        now[0] += ms / 1000
        return plan, ms

    return sched, s, step, now


def test_a_question_during_heavy_ingest_waits_at_most_one_step_within_the_target():
    # 48 tokens (the old fixed busy step) cost 62 ms on this machine: over the 40 ms target.
    truth = machine(8.0, 2.0, 1.0, 0.02)
    cfg = SchedulerConfig(step_tokens=256, chunk_tokens=128, busy_step_tokens=48, step_latency_ms=40.0,
                          busy_window_s=2.0, ingest_floor=16, background_floor=16, quiet_step_latency_ms=60.0,
                          cut_in_share=0)  # a question arriving waits for the step in flight
    m = BlockManager(8192, 16)
    sched, s, step, now = heavy_ingest(m, cfg, StepCost(), truth)
    step(branch(s, 22))  # a question opens the busy window
    for _ in range(20):  # the model learns this machine from the steps it sees
        step(branch(s, 22, ENTRY))
        now[0] = min(now[0], 1.0)  # questions keep coming: stay in the window
    assert sched.cost.ready
    for _ in range(10):
        in_flight, waited = step()  # heavy ingest runs ...
        assert in_flight.tokens_of(INGEST) > cfg.ingest_floor
        assert in_flight.predicted_ms is not None and in_flight.predicted_ms <= cfg.step_latency_ms
        assert waited <= cfg.step_latency_ms * 1.01, f"a question arriving now waits {waited:.1f} ms"
        ask = branch(s, 22)  # ... when a question arrives: its whole prompt runs in the next step
        plan, _ = step(ask)
        assert plan.items[0].seq is ask and plan.tokens_of(INTERACTIVE) == 22 and not ask.pending_ids
        assert plan.tokens_of(INGEST) == 0  # after an ingest step, the question's step is its own
        floors_ms = sum(sched.cost.item_ms(i.start_pos, len(i.token_ids)) for i in plan.items if i.seq is not ask)
        assert plan.predicted_ms - floors_ms <= cfg.step_latency_ms
        m.free(ask.table)
    now[0] += 5.0  # quiet: steps grow, within the looser quiet bound
    quiet, ms = step()
    assert quiet.tokens_of(INGEST) > in_flight.tokens_of(INGEST) and ms <= cfg.quiet_step_latency_ms * 1.01
    sched.config = dataclasses.replace(cfg, quiet_step_latency_ms=None)
    assert step()[0].tokens_of(INGEST) == 128  # unbounded (the default): the full chunk


def test_the_budget_follows_the_cost_model():
    cfg = SchedulerConfig(step_tokens=256, chunk_tokens=256, step_latency_ms=40.0, busy_window_s=60.0, cut_in_share=0)
    m = BlockManager(8192, 16)
    fast, slow = machine(4.0, 1.0, 0.2, 0.0), machine(4.0, 1.0, 0.6, 0.0)
    current = [fast]
    sched, s, step, now = heavy_ingest(m, cfg, StepCost(), lambda shape: current[0](shape))
    step(branch(s, 1))  # busy from here on
    for _ in range(12):
        plan, _ = step()
    assert abs(plan.tokens_of(INGEST) - (40 - 5) / 0.2) <= 2  # 175 tokens fit in 40 ms
    current[0] = slow  # the machine gets 3x slower per token (a neighbour, a longer context)
    for _ in range(40):
        plan, ms = step()
    assert abs(plan.tokens_of(INGEST) - (40 - 5) / 0.6) <= 2  # 58 tokens
    # Within 5%: steps of one shape cannot tell the fixed cost from the per-token cost apart.
    assert ms <= 42


def test_long_contexts_get_shorter_chunks_and_floors_hold_when_the_target_is_impossible():
    cost = StepCost(coef=(5.0, 1.0, 0.2, 0.1))  # a fixed model: attention reads cost here
    cfg = SchedulerConfig(step_tokens=256, chunk_tokens=256, step_latency_ms=40.0, ingest_floor=16,
                          background_floor=16, cut_in_share=0)
    m = BlockManager(1 << 14, 16)
    sched = Scheduler(m, cfg, cost=cost)
    short, long = session(m, "short", 5000, prefix=0), session(m, "long", 5000, prefix=8000)
    m.append(long.table, 8000)
    long.advance(8000)  # its prefix is in the cache: its data reads 8k keys per token
    sched.schedule([branch(short, 1)])  # a question: busy from here on
    near = sched.schedule([short]).tokens_of(INGEST)
    far = sched.schedule([long]).tokens_of(INGEST)
    assert far < near and cost.predict(StepShape.of([(8000, far)])) <= 40

    impossible = Scheduler(m, SchedulerConfig(step_latency_ms=1.0, ingest_floor=16, background_floor=16, cut_in_share=0),
                           cost=cost)
    s = session(m, "a", 5000)
    ask = None
    for i in range(6):  # a question pending at every step: question steps alternate with the floors' steps
        ask = ask if ask is not None and ask.pending_ids else branch(s, 30)
        entry = branch(s, 30, ENTRY)
        plan = impossible.schedule([ask, s, entry])
        if i % 2 == 0:
            assert plan.tokens_of(INTERACTIVE) == 30, "a question is never cut: it would pay a step per cut"
            assert plan.tokens_of(INGEST) == plan.tokens_of(BACKGROUND) == 0
        else:  # the floors move at least every second step, one token each at least, whatever the target
            assert plan.tokens_of(INTERACTIVE) == 0 and ask.pending_ids
            assert plan.tokens_of(INGEST) >= 1 and plan.tokens_of(BACKGROUND) >= 1, "floors are owed"
        run_fake(plan)
        if not ask.pending_ids:
            m.free(ask.table)
        m.free(entry.table)
    # Without a question the step still does work: at most half of it is overhead, the fixed cost and its
    # one item's (2 x (5 + 1) ms).
    plan = impossible.schedule([s])
    assert plan.tokens_of(INGEST) > 16 and 11 < cost.predict(plan.shape) <= 12


def test_back_to_back_questions_wait_at_most_one_short_step_and_run_alone():
    """Questions one after another while ingest and standing entries pile up: each question's step is
    its own, and between two of them ingest and background get one step of their floors, cut to the
    target, so a question never waits for more than one short step nor rides beside the floors."""
    truth = machine(8.0, 2.0, 1.0, 0.02)
    cfg = SchedulerConfig(step_tokens=256, chunk_tokens=128, step_latency_ms=40.0, busy_window_s=2.0,
                          ingest_floor=16, background_floor=16)
    m = BlockManager(8192, 16)
    sched, s, step, now = heavy_ingest(m, cfg, StepCost(), truth)
    for _ in range(20):
        step(branch(s, 22), branch(s, 22, ENTRY))
    assert sched.cost.ready
    moved = {INGEST: 0, BACKGROUND: 0}
    for _ in range(10):
        ask, entries = branch(s, 22), [branch(s, 5, ENTRY) for _ in range(4)]  # short entries: many items
        plan, _ = step(ask, *entries)
        if plan.tokens_of(INTERACTIVE) == 0:  # the floors' step the last question step owed
            assert plan.predicted_ms <= cfg.step_latency_ms * 1.01, "the floors are metered, items included"
            moved[INGEST] += plan.tokens_of(INGEST)
            moved[BACKGROUND] += plan.tokens_of(BACKGROUND)
            plan, _ = step(ask, *entries)
        assert plan.tokens_of(INTERACTIVE) == 22 and plan.num_tokens == 22, "a question's step is its own"
        m.free(ask.table)
        for entry in entries:
            m.free(entry.table)
    assert moved[INGEST] > 0 and moved[BACKGROUND] > 0


def test_a_cut_in_plans_the_questions_alone_and_uncut_beside_the_step_in_flight():
    """A question arriving while a step runs gets a step of its own between two of that step's layers
    (EngineCore._cut_in): the cut-in plan holds the questions alone, each up to a chunk, with cells of
    their own; the plan in flight keeps its cells and the scheduler's turn-taking is not moved."""
    m = BlockManager(256, 16)
    sched = Scheduler(m, SchedulerConfig(chunk_tokens=64, step_tokens=256, ingest_floor=16))
    s = session(m, "a", 200)
    in_flight = sched.schedule([s])
    assert in_flight.tokens_of(INGEST) == 64 and sched.stats.steps == 1
    flight_cells = list(s.table.blocks)
    short, long = branch(s, 30), branch(s, 100)
    cut = sched.cut_in([short, long])
    planned = {id(i.seq): (len(i.token_ids), i.sched_class, i.want_logits) for i in cut.items}
    assert planned == {id(short): (30, INTERACTIVE, short.want_logits), id(long): (64, INTERACTIVE, "none")}
    assert s.table.blocks == flight_cells and not set(short.table.blocks) & set(s.table.blocks)
    assert sched.stats.cut_in_steps == 1 and sched.stats.steps == 2
    assert not sched.cut_in([]) and sched.stats.cut_in_steps == 1
    run_fake(in_flight)
    run_fake(cut)
    # The next step runs the long question's rest, alone: questions keep coming.
    follow = sched.schedule([s, long])
    assert follow.tokens_of(INTERACTIVE) == 36 and follow.num_tokens == 36
