"""The core's components without a model: the Publisher, the Compactor, and the rules the fast path shares with the core."""

from __future__ import annotations

import json
from concurrent.futures import Future

from streamllm.config import QuestionSpec
from streamllm.engine.answers import Answerer
from streamllm.engine.compacting import Compactor
from streamllm.engine.compaction import CompactionPolicy
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.outputs import Answer, AnswerPath, ReadyRecord, StalePolicy
from streamllm.engine.publishing import EventKind, Publisher
from streamllm.engine.scheduler import SchedulerConfig
from streamllm.engine.sequence import Session
from streamllm.engine.standing.prepos import Prepositioner, answers_alone, find_standing, is_final
from streamllm.engine.stats import StepTimes
from streamllm.engine.subscriptions import SubscriptionHub
from streamllm.engine.taps import TapConfig

BLOCK = 4


class RecordingHub(SubscriptionHub):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def publish(self, session: str, kind: str, *args) -> None:
        self.events.append((session, kind, *args))


class Parts:
    """A core's components wired as EngineCore wires them, over a tiny pool and no model."""

    def __init__(self, cells: int = 256) -> None:
        self.store = KVStore(BlockManager(cells // BLOCK, BLOCK), KVPool(1, cells, 1, 2))
        self.sessions: dict[str, Session] = {}
        self.prepos = Prepositioner(self.store, {0})
        self.hub = RecordingHub()
        self.events = self.hub.events
        self.publisher = Publisher(sessions=self.sessions, prepos=self.prepos, hub=self.hub)
        config = SchedulerConfig(chunk_tokens=8)
        self.answerer = Answerer(store=self.store, prepos=self.prepos, publisher=self.publisher, tokenizer=None,
                                 eos_ids={0}, scheduler_config=config, stale_policy=StalePolicy.WAIT)
        self.compactor = Compactor(store=self.store, policy=CompactionPolicy(0.75, 0.5, 0.0), branch_cells=16,
                                   sessions=self.sessions, prepos=self.prepos, answerer=self.answerer,
                                   publisher=self.publisher, scheduler_config=config, step_times=StepTimes())

    def open(self, name: str, max_context: int = 64) -> Session:
        table = BlockTable()
        self.store.manager.reserve(table, max_context)
        s = Session(name, "sys", [1, 2, 3, 4], max_context, table)
        self.sessions[name] = s
        self.compute(s)
        return s

    def compute(self, seq) -> None:
        """What a step does to a sequence, minus the model: its pending tokens get slots and count as computed."""
        n = len(seq.pending_ids)
        if n:
            self.store.manager.append(seq.table, n)
            if isinstance(seq, Session):
                if seq.advance(n):
                    self.publisher.data(seq)
            else:
                seq.num_computed += n


def test_publisher_publishes_marked_sessions_events_and_settles_idle_waiters():
    parts = Parts()
    s = parts.open("s")
    publisher = parts.publisher
    assert publisher.records == {}
    publisher.mark("s")
    publisher.publish_records()
    assert publisher.records["s"].info == s.info()
    s.append_batch([[5, 6, 7]], 0.0)
    parts.compute(s)  # the version moves: one data event, the record rebuilt
    waiter: Future = Future()
    publisher.wait_idle(waiter)
    publisher.publish({"steps": 1}, idle=lambda: False)
    assert parts.events == [("s", EventKind.DATA, "s", 1)] and not waiter.done()
    assert publisher.records["s"].info.data_version == 1 and publisher.counters == {"steps": 1}
    publisher.publish({}, idle=lambda: True)
    assert waiter.result() is True and len(parts.events) == 1  # events go out once
    publisher.forget("s")
    assert "s" not in publisher.records


def test_compactor_starts_a_copy_at_compact_at_and_swaps_it_in_when_caught_up():
    parts = Parts()
    s = parts.open("s", max_context=64)
    compactor = parts.compactor
    for k in range(10):  # 4 prefix + 10 lines x 4 tokens = 44, under compact_at x 64
        s.append_batch([[10 + k] * 4], 0.0)
    parts.compute(s)
    compactor.maybe_start(s)
    assert not compactor.copies
    s.append_batch([[20] * 4], 0.0)  # 48: compact_at
    parts.compute(s)
    compactor.maybe_start(s)
    copy = compactor.copies["s"]
    assert copy.cut > s.prefix_len and copy.table.num_tokens == s.prefix_len  # starts on the shared prefix
    parts.compute(copy)
    assert copy.caught_up()
    before = s.compactions
    compactor.swap_caught_up()
    assert s.compactions == before + 1 and "s" not in compactor.copies
    assert s.num_tokens <= 0.5 * s.max_context  # what `retain` keeps
    parts.store.manager.check_integrity([s.table])


def test_admission_keeps_room_for_questions_or_one_copy_of_the_largest_session():
    parts = Parts()
    parts.open("big", max_context=128)
    assert parts.compactor.keep_free(32) == max(16, int(0.5 * 128))  # a copy of the largest session
    assert parts.compactor.keep_free(32) == parts.compactor.policy.keep_free(16, 128)


def test_the_fast_path_and_the_core_share_one_lookup_and_one_finality_rule():
    specs = [QuestionSpec("trend", "Is it trending up?", ("yes", "no")),
             QuestionSpec("say", "Say something.", max_tokens=4)]
    assert find_standing(specs, "trend") is specs[0]
    assert find_standing(specs, "  is IT trending up? ") is specs[0]
    assert find_standing(specs, "Something else?") is None
    parts = Parts()
    s = parts.open("s")
    for spec in specs:
        parts.prepos.register(s, spec, None, [1])  # type: ignore[arg-type]
    assert parts.prepos.find("s", "say something.").spec is specs[1]
    fired_eos = ReadyRecord("s", "say", 0, True, answers_alone(specs[1], True, 0, 4, {0}), "", 0, 2.0, None, None)
    fired_word = ReadyRecord("s", "say", 0, True, answers_alone(specs[1], True, 7, 4, {0}), "hi", 7, 2.0, None, None)
    assert fired_eos.final and not fired_word.final
    assert is_final(fired_word, specs[1], 1, {0})  # one token asked for: the gate's first token is all of it
    assert is_final(fired_word, specs[1], 4, {0}) == fired_word.final
    assert all(is_final(r, specs[0], 4, {0}) for r in (fired_eos, fired_word))  # a choice question: always


def test_answer_paths_are_strings_on_the_wire():
    a = Answer("s", "q", "up", [], 3, 0, 0.1, path=AnswerPath.FAST)
    assert a.path == "fast" and json.loads(json.dumps(a.to_dict()))["path"] == "fast"
    assert a.finish_reason == "length"


def test_tap_config_serves_no_lines_without_series_heads():
    assert TapConfig().new_taps() is None
    assert TapConfig.for_heads(None, 0, (2, "v")) == TapConfig()
    taps = TapConfig(8).new_taps()
    assert taps is not None and taps.keep == 8
