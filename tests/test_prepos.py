"""Standing questions: entries, the gate's three paths, invalidation, standing answers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamllm.config import QuestionSpec
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.standing.gate import GateError

LINES = [f"12:00:{i:02d} BTCUSDT O 640{i:02d}.5 H 640{i:02d}.9 L 639{i:02d}.1 C 640{i:02d}.2 V {i}.5" for i in range(40)]
ALWAYS, NEVER = 0.0, 1e9  # gate thresholds


@pytest.fixture()
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=2048, scheduler=SchedulerConfig(chunk_tokens=24, step_tokens=64)))
    yield eng
    eng.shutdown()


def ready(engine, name="s", lines=LINES[:6], questions=()):
    engine.open_session(name)
    for q in questions:
        engine.register(name, q)
    ack = engine.push(name, list(lines))
    engine.wait_idle()
    return ack.data_version


def cold_twin(engine, lines=LINES[:6], name="cold"):
    """A session with the same data and no standing questions: asks there take the cold path."""
    return ready(engine, name, lines)


def test_fast_path_is_the_cold_paths_first_token_without_a_model_call(engine):
    v = ready(engine, questions=[QuestionSpec("q", "What comes next?", threshold=ALWAYS, max_tokens=1)])
    calls = engine.runner.forward_calls
    fast = engine.ask("s", "q")
    assert engine.runner.forward_calls == calls  # no model call at all
    assert fast.path == "fast" and fast.tokens_computed == 0 and fast.data_version == v
    cold_twin(engine)
    cold = engine.ask("cold", "What comes next?", max_tokens=3)
    assert cold.path == "cold" and cold.data_version == v
    assert engine.tokenizer.decode(cold.tokens[:1], skip_special_tokens=True) == fast.text


def test_fast_path_choice_is_the_cold_distributions_best_choice(engine):
    spec = QuestionSpec("dir", "Up or down?", choices=("up", "down"), threshold=ALWAYS, max_tokens=2)
    ready(engine, questions=[spec])
    calls = engine.runner.forward_calls
    fast = engine.ask("s", "  up OR down? ")  # matched by normalized text
    assert engine.runner.forward_calls == calls
    assert fast.path == "fast" and fast.text in ("up", "down")
    cold_twin(engine)
    cold = engine.ask("cold", "Up or down?", max_tokens=1, return_logits=True)
    assert cold.path == "cold"
    gate = engine.prepos.find("s", "dir").gate
    decision = gate.decide(cold.logits)
    assert decision.answer == fast.text
    assert decision.gap == pytest.approx(fast.confidence, abs=1e-4)


def test_entry_path_equals_cold_path(engine):
    # push=False: no standing decode, so this ask decodes from the entry itself
    ready(engine, questions=[QuestionSpec("q", "Describe the last bar.", threshold=NEVER, max_tokens=6, push=False)])
    entry = engine.ask("s", "q")
    cold_spec = "Describe the last bar."
    cold_twin(engine)
    cold = engine.ask("cold", cold_spec, max_tokens=6)
    assert entry.path == "entry" and cold.path == "cold"
    assert entry.tokens == cold.tokens and entry.text == cold.text
    # the entry paid the question's prefill: only decode steps were computed for this answer
    assert entry.tokens_computed == len(entry.tokens) - 1 if entry.finish_reason == "length" else True
    assert cold.tokens_computed > entry.tokens_computed + len(engine.layout.question_ids(cold_spec)) - 2


def test_a_free_text_ask_on_a_current_entry_is_answered_from_its_decode_without_a_step(engine):
    spec = QuestionSpec("q", "Describe the last bar.", threshold=NEVER, max_tokens=6)  # push: decoded as idle work
    v = ready(engine, questions=[spec])
    calls = engine.runner.forward_calls
    answer = engine.ask("s", "q")
    assert engine.runner.forward_calls == calls, "a standing ask on a current entry waited for a step"
    assert answer.path == "entry" and answer.tokens_computed == 0 and answer.data_version == v
    (standing,) = engine.standing("s")
    assert answer.text == standing.text and standing.data_version == v
    cold_twin(engine)
    cold = engine.ask("cold", spec.text, max_tokens=6)
    assert answer.tokens == cold.tokens and answer.text == cold.text  # the same answer as any other path
    calls = engine.runner.forward_calls
    shorter = engine.ask("s", "q", max_tokens=2)  # not the decode it has: decoded from the entry
    assert engine.runner.forward_calls > calls and shorter.tokens == cold.tokens[:2]
    engine.push("s", LINES[6:8])  # new data: the next answer is the new version's, never the old decode
    engine.wait_idle()
    assert engine.ask("s", "q").data_version == v + 1


def test_the_first_ask_of_a_quiet_free_text_question_serves_the_next_ones(engine):
    ready(engine, questions=[QuestionSpec("q", "Describe.", threshold=NEVER, max_tokens=4, push=False)])
    first = engine.ask("s", "q")
    assert first.tokens_computed > 0  # nobody decoded it before: this ask did, from the entry
    calls = engine.runner.forward_calls
    again = engine.submit_ask("s", "q").result(30)
    assert engine.runner.forward_calls == calls
    assert (again.text, again.tokens, again.data_version) == (first.text, first.tokens, first.data_version)
    assert again.tokens_computed == 0 and again.finish_reason == first.finish_reason
    calls = engine.runner.forward_calls
    engine.ask("s", "q", stop=["."])  # stop strings may cut it elsewhere: decoded again
    assert engine.runner.forward_calls > calls


def test_new_data_invalidates_entries(engine):
    ready(engine, questions=[QuestionSpec("q", "Next?", threshold=ALWAYS, max_tokens=1)])
    st = engine.prepos.find("s", "q")
    first_entry = st.ready
    assert first_entry.data_version == 1
    ack = engine.push("s", LINES[6:9])
    engine.wait_idle()
    assert st.ready is not first_entry and st.ready.data_version == ack.data_version == 2
    answer = engine.ask("s", "q")
    assert answer.data_version == 2 and answer.path == "fast"
    assert first_entry.table is None  # the stale entry's cells went back to the pool
    engine.check_integrity()


def asked_at_ingest(engine, name="s"):
    """Submit the standing ask from the data callback: the batch is ingested, its entry not yet."""
    futures = []
    engine.subscribe_data(name, lambda _s, version: futures.append((version, engine.submit_ask(name, "q"))))
    return futures


def test_ask_while_stale_waits_for_the_fresh_entry_by_default(engine):
    ready(engine, questions=[QuestionSpec("q", "Next?", threshold=ALWAYS, max_tokens=1)])
    futures = asked_at_ingest(engine)
    engine.push("s", LINES[6:9])
    engine.wait_idle()
    (version, future), = futures
    answer = future.result(30)
    assert version == 2 and answer.data_version == 2 and not answer.stale and answer.path == "fast"


def test_stale_policy_answers_from_the_previous_version_flagged(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=2048, stale_policy="stale")) as eng:
        ready(eng, questions=[QuestionSpec("q", "Next?", threshold=ALWAYS, max_tokens=1)])
        futures = asked_at_ingest(eng)
        eng.push("s", LINES[6:9])
        eng.wait_idle()
        (version, future), = futures
        answer = future.result(30)
        assert version == 2 and answer.data_version == 1 and answer.stale
        fresh = eng.ask("s", "q")
        assert fresh.data_version == 2 and not fresh.stale


def test_subscribers_hear_only_changes(engine):
    heard = []
    engine.open_session("s")
    engine.subscribe("s", heard.append)
    data = []
    engine.subscribe_data("s", lambda name, version: data.append(version))
    engine.register("s", QuestionSpec("q", "Next?", choices=("up", "down"), threshold=ALWAYS, max_tokens=1))
    for i in range(4):
        engine.push("s", LINES[i : i + 1])
        engine.wait_idle()
    answers = engine.standing("s")
    assert len(answers) == 1 and answers[0].data_version == 4
    texts = [a.text for a in heard]
    assert all(a != b for a, b in zip(texts, texts[1:], strict=False))  # consecutive events differ
    assert heard and heard[-1].text == answers[0].text
    assert data == [1, 2, 3, 4]


def test_push_question_without_gate_is_decoded_as_idle_work(engine):
    heard = []
    engine.open_session("s")
    engine.subscribe("s", heard.append)
    engine.register("s", QuestionSpec("q", "Describe.", threshold=NEVER, max_tokens=3, push=True))
    engine.push("s", LINES[:3])
    engine.wait_idle()
    (answer,) = engine.standing("s")
    assert answer.path == "entry" and answer.data_version == 1
    assert answer.text == engine.ask("s", "Describe.", max_tokens=3).text


def test_push_false_questions_are_told_to_nobody(engine):
    heard = []
    engine.open_session("s")
    engine.subscribe("s", heard.append)
    engine.register("s", QuestionSpec("quiet", "Describe.", threshold=NEVER, max_tokens=3, push=False))
    engine.register("s", QuestionSpec("dir", "Up or down?", choices=("up", "down"), threshold=ALWAYS, push=False))
    engine.register("s", QuestionSpec("loud", "Next?", choices=("up", "down"), threshold=ALWAYS))
    engine.register("s", QuestionSpec("sure", "Say more.", threshold=ALWAYS, max_tokens=3, push=False))
    for i in range(3):
        engine.push("s", LINES[i : i + 1])
        engine.wait_idle()
    assert heard and {a.question_id for a in heard} == {"loud"}
    kept = {a.question_id: a for a in engine.standing("s")}
    assert set(kept) == {"quiet", "dir", "loud", "sure"}  # still held for `standing` and snapshots
    assert kept["quiet"].path == "gate" and kept["dir"].path == "fast" and kept["dir"].data_version == 3
    # A free-text first token is not a whole answer even where the gate fired: path "gate", not "fast".
    assert kept["sure"].path == "gate" and engine.ask("s", "sure").path == "fast"
    asked = engine.ask("s", "quiet")  # an ask decodes it from the entry
    assert asked.path == "entry" and asked.data_version == 3


def test_watch_is_an_async_iterator(engine):
    engine.open_session("s")
    engine.register("s", QuestionSpec("q", "Next?", threshold=ALWAYS, max_tokens=1))

    async def first_change():
        async for change in engine.watch("s"):
            return change

    async def main():
        task = asyncio.create_task(first_change())
        await asyncio.sleep(0.05)
        engine.push("s", LINES[:2])
        return await asyncio.wait_for(task, 30)

    change = asyncio.run(main())
    assert change.question_id == "q"


def test_register_errors_and_unregister_frees_cells(engine):
    engine.open_session("s")
    engine.register("s", QuestionSpec("q", "Next?", max_tokens=1))
    with pytest.raises(ValueError, match="already has a standing question 'q'"):
        engine.register("s", QuestionSpec("q", "Other?"))
    with pytest.raises(GateError):
        engine.register("s", QuestionSpec("c", "Pick.", choices=("up", "UP!")))
    engine.push("s", LINES[:3])
    engine.wait_idle()
    free = engine.store.manager.num_free_blocks
    engine.unregister("s", "q")
    assert engine.store.manager.num_free_blocks > free
    with pytest.raises(KeyError):
        engine.unregister("s", "q")
    engine.check_integrity()


def test_entries_of_many_questions_and_sessions_stay_consistent(engine):
    specs = [QuestionSpec(f"q{i}", f"Question number {i}?", threshold=NEVER, max_tokens=2) for i in range(4)]
    for n in ("a", "b"):
        ready(engine, n, LINES[:4], specs)
    cold_twin(engine, LINES[:4])
    for n in ("a", "b"):
        for spec in specs:
            via_entry = engine.ask(n, spec.id, return_logits=True)
            cold = engine.ask("cold", spec.text, max_tokens=2, return_logits=True)
            assert via_entry.path == "entry" and cold.path == "cold" and via_entry.tokens == cold.tokens
            assert torch.allclose(via_entry.logits, cold.logits, atol=1e-4)
    engine.check_integrity()


def test_under_pressure_idle_sessions_entries_are_evicted_first(tiny_model):
    specs = [QuestionSpec(f"q{i}", f"Standing question number {i}?", threshold=NEVER, max_tokens=1, push=False)
             for i in range(4)]
    with Engine(tiny_model, EngineConfig(max_cells=1152, block_size=8, max_context=256, branch_cells=640)) as eng:
        for name in ("a", "b"):  # both admitted before any entry takes cells
            eng.open_session(name)
        for name in ("a", "b"):
            for spec in specs:
                eng.register(name, spec)
            eng.push(name, LINES[:2])
        eng.wait_idle()
        assert all(st.ready is not None for st in eng.prepos.all())
        free_before = eng.store.manager.num_free_blocks
        # Longer than what is free (which depends on whether the two sessions' prefixes were shared),
        # within branch_cells: it cannot fit without evicting.
        question = "A long ad-hoc question that needs more cells than are free right now, "
        while len(eng.layout.question_ids(question)) <= free_before * 8:
            question += "a long ad-hoc question that needs more cells than are free right now, "
        assert len(eng.layout.question_ids(question)) < 640
        answer = eng.ask("a", question, max_tokens=1)
        assert answer.path == "cold"
        assert eng.prepos.entries_evicted >= 4
        # session data is never evicted: both sessions still hold all their tokens
        for name in ("a", "b"):
            assert eng.session_info(name).num_computed == eng.session_info(name).num_tokens
        eng.wait_idle()
        eng.check_integrity()


def test_a_question_too_big_for_the_pool_fails_clearly(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=1024, block_size=8, max_context=256, branch_cells=256)) as eng:
        eng.open_session("a")
        eng.push("a", LINES[:2])
        with pytest.raises(Exception, match="needs .* more cells"):
            eng.ask("a", "far too long a question for this pool " * 40, max_tokens=1, timeout=30)
        assert eng.ask("a", "Short?", max_tokens=1, timeout=30).path == "cold"  # and the engine goes on
        eng.check_integrity()
