"""The batcher's policy without a model: a fake runner just marks planned tokens computed.

These tests are the proof of the scheduler's guarantees (docstring of engine/scheduler.py):
questions first, ingest and background work never starved, short steps while questions
keep coming, fairness across tenants and sessions.
"""

from __future__ import annotations

import random

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


def test_questions_first_but_ingest_and_background_always_get_their_floor():
    m = BlockManager(4096, 16)
    cfg = SchedulerConfig(step_tokens=128, chunk_tokens=64, ingest_floor=16, background_floor=16)
    sched = Scheduler(m, cfg)
    s = session(m, "a", 5000)
    entry = branch(s, 40, ENTRY)
    for _ in range(30):  # a steady stream of questions, each bigger than the whole budget
        asks = [branch(s, 200) for _ in range(3)]
        plan = sched.schedule([*asks, s, entry])
        assert plan.items[0].sched_class == INTERACTIVE
        assert plan.tokens_of(INGEST) == 16, "ingest starved by questions"
        assert plan.tokens_of(BACKGROUND) == min(16, len(entry.pending_ids)) or not entry.pending_ids
        assert plan.num_tokens <= cfg.busy_step_tokens + cfg.ingest_floor + cfg.background_floor
        run_fake(plan)
    assert entry.num_computed == 40  # the entry finished under a steady question load


def test_without_questions_ingest_leads_and_background_keeps_its_share():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=128, chunk_tokens=128, background_floor=16,
                                         background_share=0.25))
    s = session(m, "a", 5000)
    entry = branch(s, 40, ENTRY)
    plan = sched.schedule([s, entry])
    assert plan.tokens_of(INGEST) == 96 and plan.tokens_of(BACKGROUND) == 32


def test_busy_window_shrinks_steps_then_quiet_restores_them():
    m = BlockManager(1024, 16)
    now = [100.0]
    sched = Scheduler(m, SchedulerConfig(step_tokens=256, chunk_tokens=128, busy_step_tokens=48,
                                         busy_window_s=2.0, ingest_floor=16, background_floor=16),
                      clock=lambda: now[0])
    s = session(m, "a", 5000)

    def step(*extra):
        plan = sched.schedule([s, *extra])
        run_fake(plan)
        return plan

    assert step().num_tokens == 128  # nobody asked yet: a full chunk
    plan = step(branch(s, 4))
    assert plan.tokens_of(INTERACTIVE) == 4 and plan.tokens_of(INGEST) == 16
    now[0] += 1.0
    assert step().tokens_of(INGEST) == 48  # a question was just served: short steps
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
    """Property: under any mix, every class with pending work gets tokens in every step."""
    rng = random.Random(7)
    m = BlockManager(1 << 14, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=96, chunk_tokens=48))
    sessions = [session(m, f"t{i % 3}/s{i}", 20_000) for i in range(6)]
    for _ in range(200):
        asks = [branch(rng.choice(sessions), rng.randint(1, 120)) for _ in range(rng.randint(0, 4))]
        bg = [branch(rng.choice(sessions), rng.randint(1, 60), rng.choice([ENTRY, DECODE]))
              for _ in range(rng.randint(0, 3))]
        plan = sched.schedule([*asks, *sessions, *bg])
        assert plan.tokens_of(INGEST) > 0
        if bg:
            assert plan.tokens_of(BACKGROUND) > 0
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
