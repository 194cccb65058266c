"""Sessions and questions on the tiny model: incremental ingest, branches, errors."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
import torch
from transformers import LlamaForCausalLM

from streamllm.engine import AdmissionError, Engine, EngineConfig, SchedulerConfig, SessionError
from streamllm.engine.commands import CloseSession
from streamllm.model import load_model

LINES = [f"12:00:{i:02d} BTCUSDT O 640{i:02d}.5 H 640{i:02d}.9 L 639{i:02d}.1 C 640{i:02d}.2 V {i}.5" for i in range(40)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture()
def engine(tiny):
    # small blocks and chunks so every path crosses block and chunk boundaries
    eng = Engine(tiny, EngineConfig(max_cells=16384, block_size=8, max_context=2048, scheduler=SchedulerConfig(chunk_tokens=24, step_tokens=64)))
    yield eng
    eng.shutdown()


def reference_logits(tiny, ids):
    hf = LlamaForCausalLM(tiny.config)
    hf.load_state_dict(tiny.state_dict, strict=False)
    hf.tie_weights()
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def test_chunked_pushes_equal_one_prefill_and_transformers(engine, tiny):
    engine.open_session("chunked")
    engine.open_session("oneshot")
    v = 0
    for chunk in ([LINES[0]], LINES[1:4], LINES[4:5], LINES[5:17], LINES[17:30]):
        v = engine.push("chunked", chunk).data_version
    engine.push("oneshot", LINES[:30])
    a = engine.ask("chunked", "Trend?", max_tokens=1, min_version=v, return_logits=True)
    b = engine.ask("oneshot", "Trend?", max_tokens=1, min_version=1, return_logits=True)
    assert a.data_version == 5 and b.data_version == 1
    assert engine.sessions["chunked"].token_ids == engine.sessions["oneshot"].token_ids
    assert (a.logits - b.logits).abs().max().item() <= 1e-4
    ids = engine.sessions["oneshot"].token_ids + engine.layout.question_ids("Trend?")
    assert (a.logits - reference_logits(tiny, ids)).abs().max().item() <= 1e-4


def test_lines_are_tokenized_once_and_appended(engine):
    engine.open_session("s")
    before = list(engine.sessions["s"].token_ids)
    engine.push("s", LINES[:2])
    engine.wait_idle()
    per_line = engine.layout.lines_ids(LINES[:2])
    assert engine.sessions["s"].token_ids == before + per_line[0] + per_line[1]


def test_ask_never_mutates_the_session(engine):
    engine.open_session("s")
    engine.push("s", LINES[:20])
    engine.wait_idle()
    s = engine.sessions["s"]
    snapshot = (list(s.table.blocks), s.table.num_tokens, list(s.token_ids), s.num_computed, s.data_version)
    first = engine.ask("s", "What was the last close?", max_tokens=6)
    second = engine.ask("s", "What was the last close?", max_tokens=6)
    assert (first.text, first.tokens) == (second.text, second.tokens)
    assert snapshot == (list(s.table.blocks), s.table.num_tokens, list(s.token_ids), s.num_computed, s.data_version)
    assert first.tokens_computed == len(engine.layout.question_ids("What was the last close?")) + 5
    engine.wait_idle()
    engine.check_integrity()


def test_answer_equals_greedy_decode_of_transformers(engine, tiny):
    engine.open_session("s")
    ack = engine.push("s", LINES[:8])
    ans = engine.ask("s", "Up or down?", max_tokens=5, min_version=ack.data_version)
    ids = engine.sessions["s"].token_ids + engine.layout.question_ids("Up or down?")
    hf = LlamaForCausalLM(tiny.config)
    hf.load_state_dict(tiny.state_dict, strict=False)
    hf.tie_weights()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ans.tokens == out[: len(ans.tokens)]


def test_concurrent_questions_on_many_sessions_equal_solo(engine):
    names = [f"s{i}" for i in range(4)]
    for i, n in enumerate(names):
        engine.open_session(n)
        engine.push(n, LINES[i : i + 10 + 3 * i])
    engine.wait_idle()
    solo = {n: engine.ask(n, "Trend?", max_tokens=4, return_logits=True) for n in names}
    futures = {n: engine.submit_ask(n, "Trend?", max_tokens=4, return_logits=True) for n in names}
    for n, fut in futures.items():
        together = fut.result(30)
        assert together.tokens == solo[n].tokens
        assert (together.logits - solo[n].logits).abs().max().item() <= 1e-4


def test_data_version_counts_batches_and_ack_reports_backlog(engine):
    engine.open_session("s")
    acks = [engine.push("s", LINES[i : i + 3]) for i in range(0, 9, 3)]
    assert [a.data_version for a in acks] == [1, 2, 3]
    assert acks[-1].queue_depth <= 9
    engine.wait_idle()
    info = engine.session_info("s")
    assert info.data_version == 3 and info.lines_ingested == 9 and engine.backlog("s") == 0


def test_ask_from_threads_and_asyncio(engine):
    engine.open_session("s")
    engine.push("s", LINES[:5])
    results = []
    threads = [threading.Thread(target=lambda: results.append(engine.ask("s", "Trend?", max_tokens=3, min_version=1)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    async def main():
        return await asyncio.gather(*(engine.ask_async("s", "Trend?", max_tokens=3) for _ in range(3)))

    results += asyncio.run(main())
    assert len({(tuple(r.tokens), r.data_version) for r in results}) == 1, [(r.tokens, r.data_version) for r in results]


def test_stop_string_cuts_the_answer(engine):
    engine.open_session("s")
    engine.push("s", LINES[:5])
    free = engine.ask("s", "Trend?", max_tokens=8, min_version=1)
    assert len(free.text) > 1
    stopped = engine.ask("s", "Trend?", max_tokens=8, stop=[free.text[1:3]])
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:1].strip()


def test_errors_are_clear_and_lose_nothing(engine):
    with pytest.raises(SessionError, match="no session named 'nope'"):
        engine.push("nope", ["x"])
    engine.open_session("s")
    with pytest.raises(SessionError, match="already open"):
        engine.open_session("s")
    engine.push("s", LINES[:2])
    with pytest.raises(ValueError, match=r"lines\[1\] contains a line break"):
        engine.push("s", ["ok", "two\nlines"])
    with pytest.raises(TypeError, match=r"lines\[0\] must be a string"):
        engine.push("s", [3])
    with pytest.raises(ValueError, match="can ever hold"):  # too big for any compaction to make room
        engine.push("s", LINES * 40)
    assert engine.session_info("s").pushed_version == 1  # the bad batches left no trace
    with pytest.raises(ValueError, match="ahead"):
        engine.ask("s", "Trend?", min_version=7)


def test_admission_refuses_when_the_pool_cannot_reserve(tiny):
    with Engine(tiny, EngineConfig(max_cells=1024, block_size=8, max_context=400, branch_cells=128)) as eng:
        eng.open_session("a")
        eng.open_session("b")
        with pytest.raises(AdmissionError, match="cannot open session 'c'"):
            eng.open_session("c")
        eng.close_session("b")
        eng.wait_idle()
        eng.open_session("c")
        eng.check_integrity()


def test_close_frees_everything(engine):
    free_before = engine.store.manager.num_free_blocks
    engine.open_session("s")
    engine.push("s", LINES[:10])
    engine.ask("s", "Trend?", max_tokens=2, min_version=1)
    engine.close_session("s")
    engine.wait_idle()
    engine.push  # noqa: B018 - engine still alive
    assert engine.store.manager.num_free_blocks == free_before
    engine.check_integrity()
    with pytest.raises(SessionError):
        engine.ask("s", "Trend?")


def test_a_cancelled_async_ask_leaves_the_engine_working(engine):
    engine.open_session("s")
    engine.push("s", LINES[:5])

    async def main():
        task = asyncio.create_task(engine.ask_async("s", "Trend?", max_tokens=6, min_version=1))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.ask_async("s", "Trend?", max_tokens=2, min_version=1)

    assert asyncio.run(main()).data_version == 1
    engine.wait_idle()
    engine.check_integrity()


def test_sessions_with_the_same_frozen_prefix_share_its_blocks(engine):
    engine.open_session("a", "Same system prompt for every instrument.")
    engine.push("a", LINES[:3])
    engine.wait_idle()
    computed_before = engine.runner.tokens_computed
    engine.open_session("b", "Same system prompt for every instrument.")
    a, b = engine.sessions["a"], engine.sessions["b"]
    shared = b.num_computed
    assert shared > 0 and shared == a.prefix_len // 8 * 8
    assert b.table.blocks[: shared // 8] == a.table.blocks[: shared // 8]
    engine.push("b", LINES[:3])
    x = engine.ask("a", "Trend?", max_tokens=2, return_logits=True)
    y = engine.ask("b", "Trend?", max_tokens=2, min_version=1, return_logits=True)
    assert (x.logits - y.logits).abs().max().item() <= 1e-4
    # b computed only its unshared prefix tail, its data and the two questions' tokens
    q = len(engine.layout.question_ids("Trend?"))
    assert engine.runner.tokens_computed - computed_before == (b.num_tokens - shared) + 2 * (q + 1)
    assert engine.stats()["prefix_cache_hits"] == 1
    engine.close_session("a")
    engine.close_session("b")
    engine.wait_idle()
    engine.check_integrity()
    assert engine.store.manager.num_used_blocks == 0  # the cached prefix went with its last session


def test_empty_push_is_refused_and_a_stopped_engine_says_so(tiny):
    eng = Engine(tiny, EngineConfig(max_cells=4096, max_context=512))
    eng.open_session("s")
    with pytest.raises(ValueError, match="at least one line"):
        eng.push("s", [])
    eng.shutdown()
    with pytest.raises(RuntimeError, match="stopped"):
        eng.push("s", ["x"])
    with pytest.raises(RuntimeError, match="stopped"):
        eng.open_session("t")


def test_tokenizing_from_many_threads_gives_the_same_ids(engine):
    """The fast tokenizer's split_special_tokens is a shared flag: encodes must not interleave."""
    layout = engine.layout
    questions = [f"Question {i} about <|im_end|> and up or down?" for i in range(8)]
    expected = {q: layout._encode(f"Question: {q}", data=True) + layout._encode(layout._tail, data=False)
                for q in questions}
    line_expected = layout.lines_ids(LINES[:4])
    errors = []

    def hammer(q):
        try:
            for _ in range(300):
                ids = layout._encode(f"Question: {q}", data=True) + layout._encode(layout._tail, data=False)
                if ids != expected[q] or layout.lines_ids(LINES[:4]) != line_expected:
                    errors.append(q)
                    return
        except Exception as exc:  # a dead thread must fail the test, not pass it
            errors.append(repr(exc))

    threads = [threading.Thread(target=hammer, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    im_end = layout.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in layout._encode(f"Question: {questions[0]}", data=True)  # data never becomes control
    assert im_end in expected[questions[0]]  # while the template's own end of turn does


def test_concurrent_pushes_to_one_session_get_distinct_versions_in_order(engine):
    """Acks are assigned by the facade: threads racing on one session must never share a version."""
    import threading

    engine.open_session("race")
    acks: list[int] = []
    lock = threading.Lock()

    def pusher(k: int) -> None:
        for i in range(40):
            ack = engine.push("race", [f"12:{k:02d}:{i:02d} 1 +{i}"])
            with lock:
                acks.append(ack.data_version)

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(acks) == list(range(1, 161))
    assert engine.wait_idle(timeout=120)
    info = engine.session_info("race")
    assert info.data_version == info.pushed_version == 160 and info.lines_ingested == 160
    assert engine.stats()["core_alive"] == 1


def _cut_in_engine(tiny, share: float = 2.0):
    # One big chunk per step, so the ingest of session b is one step a question can arrive during.
    return Engine(tiny, EngineConfig(max_cells=16384, block_size=8, max_context=4096,
                                     scheduler=SchedulerConfig(chunk_tokens=1024, step_tokens=1024,
                                                               cut_in_share=share)))


def _ask_during_ingest(eng, before=()):
    """Push 40 lines to session b and, as the step that ingests them starts (on the core thread, as if from a
    client), submit `before` (callables) and then a cold 1-token ask on a. Returns (the answer, b's computed
    tokens when it came, b's computed tokens before the push)."""
    core, asked, seen = eng.core, [], []
    execute = core.runner.execute

    def starting(works, **kw):
        if not asked and any(w.table is eng.sessions["b"].table for w in works):
            for submit in before:
                submit()
            future = eng.submit_ask("a", "Trend?", max_tokens=1, return_logits=True)
            future.add_done_callback(lambda _: seen.append(eng.sessions["b"].num_computed))
            asked.append(future)
        return execute(works, **kw)

    core.runner.execute = starting
    computed = eng.sessions["b"].num_computed
    eng.push("b", LINES[:40])
    assert eng.wait_idle(30)
    return asked[0].result(5), seen[0], computed


def test_a_question_cuts_into_a_running_step_and_answers_as_it_would_have_before_it(tiny):
    eng = _cut_in_engine(tiny)
    try:
        eng.open_session("a")
        eng.open_session("b")
        eng.push("a", LINES[:20])
        eng.wait_idle()
        idle = eng.ask("a", "Trend?", max_tokens=1, return_logits=True)
        answer, b_at_answer, b_before = _ask_during_ingest(eng)
        assert b_at_answer == b_before  # answered inside the step that ingests b, before it ended
        assert eng.scheduler.stats.cut_in_steps == 1
        assert answer.data_version == idle.data_version and answer.text == idle.text
        assert (answer.logits - idle.logits).abs().max().item() <= 1e-4
        assert eng.sessions["b"].num_computed > b_before  # and the step it cut into finished its work
        after = eng.ask("b", "Trend?", max_tokens=1, return_logits=True)
        eng.open_session("c")
        ack = eng.push("c", LINES[:40])
        alone = eng.ask("c", "Trend?", max_tokens=1, return_logits=True, min_version=ack.data_version)
        assert after.data_version == alone.data_version == 1
        assert (after.logits - alone.logits).abs().max().item() <= 1e-4  # b's cells are as if never cut
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("share, before", [(2.0, "push"), (2.0, "close"), (0.0, "")])
def test_a_question_overtakes_only_pushes_sent_before_it_and_never_when_cut_ins_are_off(tiny, share, before):
    """A push only queues data no cut-in computes, so an ask may be applied before one sent ahead of it
    (the push keeps its place among the other commands); any other command keeps the asks behind it."""
    eng = _cut_in_engine(tiny, share)
    try:
        for name in "abc":
            eng.open_session(name)
        eng.push("a", LINES[:20])
        eng.wait_idle()
        applied, apply = [], eng.core._apply
        eng.core._apply = lambda cmd: (applied.append((type(cmd).__name__, getattr(cmd, "name", None))), apply(cmd))
        sends = {"push": [functools.partial(eng.push, "a", [LINES[20]]), functools.partial(eng.push, "c", LINES[:2])],
                 "close": [functools.partial(eng.core.submit, CloseSession("c"))], "": []}[before]
        answer, b_at_answer, b_before = _ask_during_ingest(eng, sends)
        applied = [c for c in applied if c[0] != "WaitIdle"]
        if before == "push":  # cut in ahead of both pushes, which then apply in the order they came
            assert eng.scheduler.stats.cut_in_steps == 1 and b_at_answer == b_before
            assert applied == [("Push", "b"), ("Ask", "a"), ("Push", "a"), ("Push", "c")]
        else:  # behind the close (or with cut-ins off): it waited for the step, in the order sent
            assert eng.scheduler.stats.cut_in_steps == 0 and b_at_answer > b_before
            assert applied == [("Push", "b"), *([("CloseSession", "c")] if before else []), ("Ask", "a")]
        assert answer.data_version == 1  # the push to a was queued, not computed, when a was read: either way
        eng.check_integrity()
    finally:
        eng.shutdown()
