"""Cells on demand: admission by working set, sessions that grow in runs, room made under pressure,
entries that never starve each other, idle sessions spilled to disk and restored bit for bit
(engine/admission.py, engine/kv.py)."""

from __future__ import annotations

import itertools
import re
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from streamllm.config import QuestionSpec, parse_question
from streamllm.durability.resident import ResidentEngine
from streamllm.engine import AdmissionError, Engine, EngineConfig, SchedulerConfig
from streamllm.engine.admission import Admission
from streamllm.engine.answers import Answerer
from streamllm.engine.compacting import Compactor
from streamllm.engine.compaction import CompactionCopy, CompactionPolicy
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.outputs import StalePolicy
from streamllm.engine.publishing import Publisher
from streamllm.engine.sequence import AskBranch, EntryBranch, Session
from streamllm.engine.standing.prepos import Prepositioner
from streamllm.engine.stats import StepTimes
from streamllm.engine.subscriptions import SubscriptionHub

QUESTION = "What is the last close?"


def bars(k: int):
    for i in itertools.count():
        yield f"12:{i // 60 % 60:02d}:{i % 60:02d} S{k} C {6400 + (i * 7 + k) % 97}.5 V {i % 13}"


# -- the rule without a model ------------------------------------------------------------------
BLOCK, POOL, CHUNK = 4, 256, 8


class CellsMachine(RuleBasedStateMachine):
    """The core's cell bookkeeping (admission, growth in runs, compaction, pressure relief, branches)
    driven by random opens, pushes, steps, asks and closes, as the core's loop drives it, minus the model."""

    def __init__(self) -> None:
        super().__init__()
        self.store = KVStore(BlockManager(POOL // BLOCK, BLOCK, grow_blocks=4), KVPool(1, POOL, 1, 2))
        self.m = self.store.manager
        self.sessions: dict[str, Session] = {}
        prepos = Prepositioner(self.store, {0})
        publisher = Publisher(sessions=self.sessions, prepos=prepos, hub=SubscriptionHub())
        config = SchedulerConfig(chunk_tokens=CHUNK)
        answerer = Answerer(store=self.store, prepos=prepos, publisher=publisher, tokenizer=None, eos_ids={0},
                            scheduler_config=config, stale_policy=StalePolicy.WAIT)
        self.compactor = Compactor(store=self.store, policy=CompactionPolicy(0.75, 0.5, 0.0), branch_cells=32,
                                   sessions=self.sessions, prepos=prepos, answerer=answerer, publisher=publisher,
                                   scheduler_config=config, step_times=StepTimes())
        self.admission = Admission(store=self.store, compactor=self.compactor, prepos=prepos, publisher=publisher,
                                   sessions=self.sessions, window_tokens=24, chunk_tokens=CHUNK, grace_s=0.0)
        self.branches: list[BlockTable] = []
        self.names = itertools.count()
        self.refused = 0

    @rule(max_context=st.sampled_from([16, 48, 128, 256]))
    def open(self, max_context: int) -> None:
        name = f"s{next(self.names)}"
        cells = self.admission.working_set(3, max_context)
        try:
            self.admission.admit(name, cells, max_context)
        except AdmissionError as exc:
            assert re.search(rf"its working set needs {cells} cells, the pool has \d+ free and keeps \d+ free",
                             str(exc))
            self.refused += 1
            return
        table = BlockTable(grow_to=max_context)
        self.m.reserve(table, cells)
        self.sessions[name] = Session(name, "sys", [1, 2, 3], max_context, table, working_set=cells)

    @rule(data=st.data(), lines=st.lists(st.integers(1, 12), min_size=1, max_size=8))
    def push(self, data, lines: list[int]) -> None:
        if self.sessions:
            name = data.draw(st.sampled_from(sorted(self.sessions)))
            self.sessions[name].append_batch([[5] * n for n in lines], 0.0)

    @rule()
    def step(self) -> None:
        """One turn of the core: relieve pressure, keep copies moving, then one chunk of each sequence."""
        self.admission.relieve()
        self.compactor.keep_moving()
        for seq in [*self.sessions.values(), *self.compactor.copies.values()]:
            n = min(len(seq.pending_ids), CHUNK)
            if n <= 0 or not self.m.can_append(seq.table, n):
                continue
            grows_into_free = seq.table.grows and self.m.blocks_needed(seq.table, n) > 0
            self.m.append(seq.table, n)
            if grows_into_free:  # growth never takes the cells kept for branches and copies
                assert self.m.num_free_blocks >= self.m.keep_free
            if isinstance(seq, CompactionCopy):
                seq.num_computed += n
            else:
                seq.advance(n)
                self.compactor.maybe_start(seq)
        self.compactor.swap_caught_up()

    @rule(data=st.data(), tokens=st.integers(1, 20))
    def ask(self, data, tokens: int) -> None:
        ready = sorted(n for n, s in self.sessions.items() if s.num_computed)
        if ready:
            s = self.sessions[data.draw(st.sampled_from(ready))]
            if self.m.num_free_blocks:
                branch = self.store.fork(s.table, s.num_computed)
                self.branches.append(branch)
                if self.m.can_append(branch, tokens):
                    self.m.append(branch, tokens)

    @rule()
    def answer(self) -> None:
        if self.branches:
            self.m.free(self.branches.pop(0))

    @rule(data=st.data())
    def close(self, data) -> None:
        if self.sessions:
            name = data.draw(st.sampled_from(sorted(self.sessions)))
            self.compactor.forget(name)
            self.m.free(self.sessions.pop(name).table)

    @invariant()
    def never_overcommitted(self) -> None:
        m = self.m
        tables = [s.table for s in self.sessions.values()] + self.compactor.tables() + self.branches
        m.check_integrity(tables)  # refcounts, free list: nothing handed out twice or beyond the pool
        assert 0 <= m.num_free_blocks <= m.num_blocks
        working_sets = sum(m.blocks_for(s.working_set) for s in self.sessions.values())
        assert working_sets + m.keep_free <= m.num_blocks, "admitted working sets overcommit the pool"
        for s in self.sessions.values():  # a session is never short of its working set: it never waits inside it
            assert len(s.table.blocks) + len(s.table.reserved) >= m.blocks_for(s.working_set) or s.table.num_tokens == 0
            assert s.table.num_tokens == s.num_computed <= s.max_context


TestAdmissionNeverOvercommits = CellsMachine.TestCase
TestAdmissionNeverOvercommits.settings = settings(max_examples=60, stateful_step_count=60, deadline=None,
                                                  suppress_health_check=[HealthCheck.too_slow])


def test_growing_tables_take_runs_that_grow_with_them_and_give_back_what_they_do_not_fill():
    m = BlockManager(64, 4, grow_blocks=4)
    m.keep_free = 8
    t = BlockTable(grow_to=80)  # a session of max_context 80: 20 blocks
    m.reserve(t, 8)  # its working set: 2 blocks
    m.append(t, 8)
    m.append(t, 1)  # past it: a run of grow_blocks right after its last block
    assert t.blocks == [0, 1, 2] and t.reserved == [3, 4, 5]
    m.append(t, 12)
    wall = BlockTable()
    m.reserve(wall, 8)  # a branch's blocks right after t's run
    assert wall.reserved == [6, 7]
    m.append(t, 4)  # t's next run starts past them
    m.append(t, 12)
    m.append(t, 4)  # 11 blocks: a run of half what it holds (5), not grow_blocks (4)
    assert t.blocks == [*range(6), *range(8, 13)] and t.reserved == [13, 14, 15, 16]
    assert m.runs(t) == [(0, 0, 24), (24, 32, 17)]
    m.append(t, 39)  # a run of 7 would pass its max_context: 5
    assert t.blocks == [*range(6), *range(8, 22)] and not t.reserved
    short = BlockTable(grow_to=400)
    m.reserve(short, 8)
    m.append(short, 9)
    assert len(short.reserved) == 3 and m.trim(short, 8) == 3 and not short.reserved and m.num_reserved == 2
    other = BlockTable(grow_to=4 * 64)
    m.append(other, 4 * (m.num_free_blocks - m.keep_free))  # everything but keep_free
    assert not m.can_append(other, 1) and not m.can_append(short, 4)
    assert m.can_append(BlockTable(), 4 * 8)  # branches and copies may take the kept blocks
    m.check_integrity([t, wall, short, other])


# -- on the engine ----------------------------------------------------------------------------------
def test_twenty_four_sessions_open_on_the_default_pool_that_reserving_max_context_held_seven_of(tiny_model):
    config = EngineConfig()  # 65,536 cells, max_context 8,192
    keep = max(config.reserved_branch_cells, config.compaction.copy_cells(config.max_context))
    assert (config.max_cells - keep) // config.max_context == 7  # the old rule: max_context reserved at open
    with Engine(tiny_model, config) as eng:
        feeds = {f"s{k}": bars(k) for k in range(24)}
        for name in feeds:
            eng.open_session(name)
        for name, feed in feeds.items():
            eng.push(name, list(itertools.islice(feed, 3)))
        assert eng.wait_idle(120)
        assert all(eng.session_info(n).data_version == 1 for n in feeds)
        assert eng.working_set() == eng.prefix_tokens() + config.working_set_tokens
        assert eng.ask("s23", QUESTION, max_tokens=1, timeout=60).tokens
        stats = eng.stats()
        assert stats["sessions"] == 24 and stats["cells_wanted"] == 0 and stats["admissions_refused"] == 0
        eng.check_integrity()


def test_a_full_pool_refuses_an_open_naming_what_it_needed_and_what_was_free(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=2048, block_size=16, max_context=1024, branch_cells=256,
                                         working_set_tokens=256)) as eng:
        cells = eng.working_set()
        opened = 0
        with pytest.raises(AdmissionError) as refused:
            for k in range(20):
                eng.open_session(f"s{k}")
                opened += 1
        assert 2 <= opened < 20
        match = re.search(r"cannot open session 's\d+': its working set needs (\d+) cells, the pool has (\d+) free "
                          r"and keeps (\d+) free for questions and compaction copies", str(refused.value))
        assert match, str(refused.value)
        needed, free, keep = map(int, match.groups())
        assert needed == cells and free < needed + keep
        assert eng.stats()["admissions_refused"] == 1
        eng.check_integrity()


def _grow(eng, name: str, feed, cells: int) -> None:
    """Push to `name` until it holds `cells` tokens (waiting for each push: records lag pushes)."""
    while eng.session_info(name).num_tokens < cells:
        eng.push(name, list(itertools.islice(feed, 4)))
        assert eng.wait_idle(60)


def test_sessions_past_their_working_sets_compact_down_to_them_when_the_pool_is_short(tiny_model):
    """Three sessions admitted by small working sets outgrow a pool that could never hold their budgets:
    they grow while it has room, then the one furthest past its working set compacts down to it; every
    push is ingested, none waits forever, and the cells stay consistent."""
    config = EngineConfig(max_cells=2048, block_size=16, max_context=1536, branch_cells=256, working_set_tokens=256,
                          growth_cells=128, check_integrity_every_step=True,
                          compaction=CompactionPolicy(safety=0.0))  # no early copies: only pressure cuts early
    with Engine(tiny_model, config) as eng:
        feeds = {f"s{k}": bars(k) for k in range(3)}
        for name in feeds:
            eng.open_session(name)
        for _ in range(40):
            for name, feed in feeds.items():
                eng.push(name, list(itertools.islice(feed, 3)))
        assert eng.wait_idle(180), eng.stats()
        stats = eng.stats()
        assert stats["pressure_compactions"] >= 1 and stats["cells_wanted"] == 0
        for name in feeds:
            info = eng.session_info(name)
            assert info.data_version == info.pushed_version == 40 and info.backlog_lines == 0
        assert sum(eng.session_info(n).compactions for n in feeds) >= 1
        eng.check_integrity()


def test_a_session_that_spills_and_restores_answers_exactly_as_before(tiny_model, tmp_path):
    """A session grown past its working set in several runs is spilled to disk and restored by its next
    use (here an ask): it answers bit for bit as it did before the spill (the restore lays its cells out
    in the runs they had)."""
    config = EngineConfig(max_cells=8192, block_size=16, max_context=4096, branch_cells=512, working_set_tokens=128,
                          growth_cells=64)
    with ResidentEngine(Engine(tiny_model, config), tmp_path / "spill") as eng:
        eng.open_session("a")
        eng.open_session("b")
        feeds = {"a": bars(1), "b": bars(2)}
        for _ in range(12):  # interleaved growth: a's cells end up in several runs
            for name, feed in feeds.items():
                eng.push(name, list(itertools.islice(feed, 1)))
            assert eng.wait_idle(60)
        runs = eng.engine.call(lambda core: len(core.store.manager.runs(core.sessions["a"].table)))
        assert runs > 1
        before = eng.ask("a", QUESTION, max_tokens=3, return_logits=True, timeout=60)
        info = eng.session_info("a")
        eng.evict_session("a")
        assert "a" in eng.evicted()
        after = eng.ask("a", QUESTION, max_tokens=3, return_logits=True, timeout=60)  # restores it first
        assert "a" not in eng.evicted()
        assert after.data_version == before.data_version == info.data_version
        assert after.tokens == before.tokens and torch.equal(after.logits, before.logits)
        assert eng.engine.call(lambda core: len(core.store.manager.runs(core.sessions["a"].table))) == runs
        eng.engine.check_integrity()


def test_idle_sessions_spill_to_disk_when_growing_sessions_run_the_pool_short(tiny_model, tmp_path):
    """Pool pressure from growth (not a refused open) reaches a ResidentEngine through stats: it spills idle
    sessions, least recently used first; a spilled session comes back on its next push, as it was."""
    config = EngineConfig(max_cells=2048, block_size=16, max_context=1024, branch_cells=256, working_set_tokens=256,
                          growth_cells=128, compaction=CompactionPolicy(safety=0.0))  # no early copies
    with ResidentEngine(Engine(tiny_model, config), tmp_path / "spill", auto_evict=True) as eng:
        # compaction waits: only spilling can make room here
        eng.engine.call(lambda core: setattr(core.admission, "grace_s", 60.0))
        feeds = {f"s{k}": bars(k) for k in range(3)}
        for name in feeds:
            eng.open_session(name)
        _grow(eng, "s0", feeds["s0"], 600)
        _grow(eng, "s1", feeds["s1"], 600)
        idle = eng.session_info("s0")
        assert idle.compactions == eng.session_info("s1").compactions == 0
        for _ in range(30):  # s2 grows into a pool s0 and s1 have taken
            eng.push("s2", list(itertools.islice(feeds["s2"], 3)))
            eng.wait_idle(2)
            if eng.stats()["pressure_spills"]:
                break
        assert eng.wait_idle(60)
        stats = eng.stats()
        assert stats["pressure_spills"] >= 1 and "s0" in eng.evicted(), stats  # the least recently used went first
        assert stats["pressure_compactions"] == 0, stats
        info = eng.session_info("s2")
        assert info.data_version == info.pushed_version
        eng.push("s0", list(itertools.islice(feeds["s0"], 1)))  # its next bar brings it back
        assert "s0" not in eng.evicted() and eng.wait_idle(60)
        assert eng.session_info("s0").data_version == idle.data_version + 1
        eng.engine.check_integrity()


def test_when_every_entry_computing_is_blocked_the_newest_give_way_until_the_oldest_moves():
    """Issue #44's rule for background work: with nothing else in flight to give cells back, entries
    all blocked on cells do not wait on each other forever; the newest are preempted (cells freed,
    recomputed later) until the oldest can take its next chunk, and the oldest is never preempted."""
    store = KVStore(BlockManager(16, 4), KVPool(1, 64, 1, 2))
    m = store.manager
    prepos = Prepositioner(store, {0})
    publisher = Publisher(sessions={}, prepos=prepos, hub=SubscriptionHub())
    answerer = Answerer(store=store, prepos=prepos, publisher=publisher, tokenizer=None, eos_ids={0},
                        scheduler_config=SchedulerConfig(chunk_tokens=16), stale_policy=StalePolicy.WAIT)
    table = BlockTable()
    m.append(table, 6)
    s = Session("s", "sys", [1, 2, 3], 64, table)
    s.append_batch([[5, 5, 5]], 0.0)
    s.advance(6)
    entries = []
    for k in range(3):  # each: its fork's tail block (2 of 4 slots used), then 10 question tokens: 2 blocks more
        st = prepos.register(s, QuestionSpec(f"q{k}", f"Say {k}.", max_tokens=1), None, [7] * 10)  # type: ignore[arg-type]
        assert prepos.start_blocks(st) == 3
        st.computing = EntryBranch(s, st.spec.text, st.prompt_ids, table=store.fork(table, 6), base_len=6,
                                   data_version=1, standing=st)
        entries.append(st.computing)
    wall = BlockTable()  # everything else in the pool but one block
    m.append(wall, 4 * (m.num_free_blocks - 1))
    assert prepos.blocks_to_finish() == 6 and m.num_free_blocks == 1
    answerer.make_room()
    assert prepos.entries_preempted == 1 and entries[2].table is None and entries[2].standing.computing is None
    assert [e.table is not None for e in entries[:2]] == [True, True]
    assert m.can_append(entries[0].table, 10)  # the oldest moves: it lands and gives its cells back
    m.check_integrity([table, wall, entries[0].table, entries[1].table])
    m.append(wall, 4 * m.num_free_blocks)  # the pool full: a question still gets in, entries give way
    ask = AskBranch(s, "What now?", [9] * 3, future=Future())
    answerer.waiting.append(ask)
    answerer.start_waiting()
    assert answerer.running == [ask] and not ask.future.done() and ask.table is not None
    assert [e.table is None for e in entries] == [True, True, True]
    m.check_integrity([table, wall, ask.table])


def _fleet(eng: Engine, questions: list[dict], bars: int) -> list[str]:
    """Four sessions with these standing questions each, fed `bars` bars one at a time, round robin;
    the engine must then go idle (its cell and entry counters say why not)."""
    names = [f"s{k}" for k in range(4)]
    for name in names:
        eng.open_session(name)
        for q in questions:
            eng.register(name, parse_question(q))
    for b in range(bars):
        for k, name in enumerate(names):
            eng.push(name, [f"00:{b:02d} {46000 + b * 7 + k} +{b % 9} h+3 l-2 v1.{b}M n{100 + b} b5{b % 10}"])
    assert eng.wait_idle(30), {k: v for k, v in eng.stats().items() if "cell" in k or "entr" in k}
    return names


def test_entries_do_not_starve_each_other_in_a_pool_sessions_nearly_fill(tiny_model):
    """The bench's deadlock (#46) in small: sessions admitted by working set leave little beside them,
    and four choice questions each keep entries on top. A choice question's ready entry gives its
    cells back (its answer is the ready record on every path) and entries start only whole beside
    the others, so the engine goes idle with every answer fresh and the cells consistent."""
    config = EngineConfig(max_cells=2048, block_size=16, max_context=512, branch_cells=256, working_set_tokens=256,
                          check_integrity_every_step=True)
    with Engine(tiny_model, config) as eng:
        names = _fleet(eng, [{"id": f"q{q}", "text": f"Question {q}: is the price going up? Answer up or down.",
                              "choices": ["up", "down"]} for q in range(4)], bars=10)
        for name in names:
            version = eng.session_info(name).data_version
            answers = eng.standing(name)
            assert version == 10 and len(answers) == 4 and all(a.data_version == version for a in answers)
        held = eng.call(lambda core: [st.ready.table for st in core.prepos.all() if st.ready is not None])
        assert len(held) == 16 and held == [None] * 16
        assert eng.stats()["cells_wanted"] == 0
        eng.check_integrity()


def test_entries_do_not_take_back_the_room_made_for_sessions_blocked_on_growth(tiny_model):
    """Free-text entries keep their cells: when sessions growing past their working sets are short,
    the entries evicted for them must not be started again into the room they wait for (ingest comes
    before background work), else every turn evicts and re-forks the entries and no line lands."""
    config = EngineConfig(max_cells=2048, block_size=16, max_context=1024, branch_cells=256, working_set_tokens=256,
                          check_integrity_every_step=True)
    with Engine(tiny_model, config) as eng:
        names = _fleet(eng, [{"id": f"q{q}", "text": f"Question {q}: where does the price go?", "max_tokens": 1}
                             for q in range(2)], bars=16)
        for name in names:
            answers = eng.standing(name)
            assert eng.session_info(name).data_version == 16 and [a.data_version for a in answers] == [16, 16]
        assert eng.call(lambda core: core.prepos.entries_evicted) < 100  # a few per shortage, not one per turn
        assert eng.stats()["cells_wanted"] == 0
        eng.check_integrity()
