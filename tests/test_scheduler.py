"""The batcher's policy without a model: a fake runner just marks planned tokens computed."""

from __future__ import annotations

from streamllm.engine.kv import BlockManager, BlockTable
from streamllm.engine.scheduler import (
    IDLE,
    INGEST,
    INTERACTIVE,
    Plan,
    Scheduler,
    SchedulerConfig,
    fair_order,
)
from streamllm.engine.sequence import Branch, Session


def session(m: BlockManager, name: str, pending: int, prefix: int = 4) -> Session:
    t = BlockTable()
    m.reserve(t, prefix + pending + 64)
    s = Session(name, "sys", list(range(prefix)), 4096, t)
    s.append_batch([list(range(pending))])
    return s


def branch(m: BlockManager, s: Session, n_prompt: int, purpose: str = "ask") -> Branch:
    br = Branch(s, "q", list(range(n_prompt)), 4, [], None, purpose=purpose)
    br.table = BlockTable()
    return br


def run_fake(plan: Plan) -> None:
    """What the runner + engine update would do, minus the model."""
    for item in plan.items:
        if item.kind == INGEST:
            item.owner.advance(len(item.token_ids))
        else:
            item.owner.num_computed += len(item.token_ids)


def test_priorities_interactive_then_ingest_then_idle():
    m = BlockManager(256, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=64, chunk_tokens=32))
    s = session(m, "a", 100)
    ask, entry = branch(m, s, 10), branch(m, s, 10, "entry")
    plan = sched.schedule([ask], [s], [entry])
    assert [i.kind for i in plan.items] == [INTERACTIVE, INGEST]
    assert plan.num_tokens <= 10 + 16
    assert sched.stats.idle_preempted == 1
    run_fake(plan)
    while s.pending_tokens:  # idle waits for ingest too
        plan = sched.schedule([], [s], [entry])
        assert all(i.kind == INGEST for i in plan.items)
        run_fake(plan)
    plan = sched.schedule([], [s], [entry])
    assert [i.kind for i in plan.items] == [IDLE]


def test_budget_and_chunking_bound_a_questions_wait():
    m = BlockManager(512, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=48, chunk_tokens=32))
    s = session(m, "a", 1000)
    run_fake(sched.schedule([], [s]))
    assert s.num_computed == 32  # one chunk of ingest per step
    ask = branch(m, s, 20)
    plan = sched.schedule([ask], [s])  # the very next step serves the question
    assert plan.items[0].owner is ask and len(plan.items[0].token_ids) == 20
    assert plan.tokens_of(INGEST) == 16  # only a trickle of ingest rides along with a question
    for item in plan.items:
        assert len(item.token_ids) <= 32


def test_partial_chunks_ask_for_no_logits():
    m = BlockManager(64, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=16, chunk_tokens=16))
    s = session(m, "a", 0)
    ask = branch(m, s, 40)
    first = sched.schedule([ask], [])
    assert first.items[0].want_logits == "none"
    run_fake(first)
    run_fake(sched.schedule([ask], []))
    last = sched.schedule([ask], [])
    assert len(last.items[0].token_ids) == 8 and last.items[0].want_logits == "last"


def test_fair_across_sessions_and_tenants():
    m = BlockManager(4096, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=32, chunk_tokens=32))  # one chunk per step
    many = [session(m, f"alice/s{i}", 10_000) for i in range(5)]
    one = session(m, "bob/s", 10_000)
    served = {s.name: 0 for s in [*many, one]}
    for _ in range(40):
        plan = sched.schedule([], [*many, one])
        for item in plan.items:
            served[item.owner.name] += len(item.token_ids)
        run_fake(plan)
    assert served["bob/s"] == sum(v for k, v in served.items() if k.startswith("alice/"))
    alice = [v for k, v in served.items() if k.startswith("alice/")]
    assert max(alice) - min(alice) <= 32


def test_fair_order_interleaves_tenants_then_sessions():
    class B:
        def __init__(self, name):
            self.name = name

    items = [B("a/x"), B("a/x"), B("a/y"), B("b/z")]
    order = [b.name for b in fair_order(items, lambda b: b.name, 0)]
    assert order[:2] == ["a/x", "b/z"] and sorted(order) == sorted(b.name for b in items)


def test_no_cells_skips_a_sequence_without_breaking_the_plan():
    m = BlockManager(7, 16)
    sched = Scheduler(m, SchedulerConfig(step_tokens=256, chunk_tokens=256))
    s = session(m, "a", 40)  # reserves all 7 blocks
    ask = branch(m, s, 10)  # needs a free block: none left
    plan = sched.schedule([ask], [s])
    assert [i.kind for i in plan.items] == [INGEST] and sched.stats.blocked == 1
    m.check_integrity([s.table, ask.table])


def test_background_steps_shrink_while_questions_keep_coming():
    m = BlockManager(1024, 16)
    now = [100.0]
    sched = Scheduler(m, SchedulerConfig(step_tokens=256, chunk_tokens=128, busy_step_tokens=32,
                                         busy_window_s=2.0), clock=lambda: now[0])
    s = session(m, "a", 5000)

    def step(questions=()):
        plan = sched.schedule(list(questions), [s])
        run_fake(plan)
        return plan

    assert step().num_tokens == 128  # nobody asked yet: a full chunk
    step([branch(m, s, 4)])
    now[0] += 1.0
    assert step().tokens_of(INGEST) == 32  # a question was just served: short steps
    now[0] += 1.5
    assert step().tokens_of(INGEST) == 128  # quiet again
