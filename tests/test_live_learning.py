"""Live learning (engine/standing/learning.py): a labelled question without a head learns one from its session's
line features, every answer scored before its own sample is trained on."""

from __future__ import annotations

import time

import pytest
import torch

from streamllm.config import parse_question
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.standing.learning import LearnConfig
from streamllm.engine.taps import LINE_SLACK, NUMBER_WIDTH

QUESTION = {"id": "rising", "text": "Did the last bar rise?", "choices": ["yes", "no"],
            "label": "trend_up(n=1)", "threshold": "auto:0.9"}


def _line(i: int, up: bool) -> str:
    return f"00:{i % 60:02d} {100 + i % 7}.5 {'+' if up else '-'}{1 + i % 4} v{1 + i % 3}"


def _wait_for_fit(engine: Engine, fits: int, timeout: float = 60.0) -> None:
    """Until `fits` heads were swapped in. The learner's own count: the published figures are as of the
    latest answer, and a fit that ends after the last push has no answer after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.call(lambda core: core.prepos.by_session["s"]["rising"].learner.fits) >= fits:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {fits} fits in {timeout} s: {engine.calibration()}")


def test_a_labelled_question_learns_and_is_scored_only_on_answers_its_heads_never_saw(tiny_model) -> None:
    config = EngineConfig(max_cells=8192, max_context=4096,
                          learning=LearnConfig(lines=4, min_samples=48, every=24, steps=120))
    rng = [bool((i * 7919) % 11 % 2) for i in range(200)]  # the truth: whether the line rose
    with Engine(tiny_model, config) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        answers = {}
        for i, up in enumerate(rng[:130]):
            if i == 120:  # the first head (48 samples) is in; the next fit starts with the next sample
                _wait_for_fit(engine, 1)
            ack = engine.push("s", [_line(i, up)], truths={"rising": "yes" if up else "no"})
            assert engine.wait_idle(timeout=60)
            answers[ack.data_version] = engine.standing("s")[0].text
        _wait_for_fit(engine, 2)  # a head of 100+ samples answers the late versions
        for i, up in enumerate(rng[130:], start=130):
            ack = engine.push("s", [_line(i, up)], truths={"rising": "yes" if up else "no"})
            assert engine.wait_idle(timeout=60)
            answers[ack.data_version] = engine.standing("s")[0].text
        learner = engine.call(lambda core: core.prepos.by_session["s"]["rising"].learner)
        cal = engine.calibration()["s"]["rising"]
    assert cal["learning"]["fits"] >= 2 and cal["learning"]["samples"] >= 150
    # Prequential: each sample was answered by a head trained only on older versions than its own.
    assert all(head_upto < version for version, _, _, _, head_upto in learner.samples)
    late = [(answers[v] == ("yes" if rng[v - 1] else "no")) for v in range(161, 201)]
    assert sum(late) / len(late) >= 0.9, late  # the sign of the change is in the line: a head finds it
    # The learning curve shows it: chance before the first head, right after; the gate opens on the way.
    curve = cal["history"]
    assert [p[0] for p in curve] == list(range(10, 201, 10))
    assert curve[3][1] <= 0.7 and curve[-1][1] >= 0.9 and not curve[0][3] and curve[-1][3]
    # The control (the same head on the lines' own numbers: the change's sign is one of them) answered the
    # same versions from the first fit on, scored beside the answers given, prequentially as they were.
    learning = cal["learning"]
    assert 40 <= learning["compared"] <= 200 - 48
    assert learning["control_accuracy"] >= 0.8 and 0 <= learning["answer_accuracy"] <= 1


def test_a_snapshot_keeps_the_learned_head_its_samples_and_calibration(tiny_model, tmp_path) -> None:
    from streamllm.durability.snapshot import restore_session, save_session

    config = EngineConfig(max_cells=8192, max_context=4096,
                          learning=LearnConfig(lines=4, min_samples=32, every=1000, steps=60))
    truth = [bool((i * 7919) % 11 % 2) for i in range(80)]
    with Engine(tiny_model, config) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        for i, up in enumerate(truth[:60]):
            engine.push("s", [_line(i, up)], truths={"rising": "yes" if up else "no"})
            assert engine.wait_idle(timeout=60)
        _wait_for_fit(engine, 1)
        engine.push("s", [_line(60, True)], truths={"rising": "yes"})  # answered by the learned head
        assert engine.wait_idle(timeout=60)
        learned_answer = engine.standing("s")[0]
        save_session(engine, "s", tmp_path / "s.snap")
        live = engine.calibration()["s"]["rising"]
        head = engine.call(lambda core: core.prepos.by_session["s"]["rising"].gate.head)
        live_control = engine.call(lambda core: core.prepos.by_session["s"]["rising"].learner.control)
    # The head reads each line's model states and, beside them, the line's own numbers.
    assert head.numbers == NUMBER_WIDTH and head.proj.shape[1] == 2 * 64 + 64 + NUMBER_WIDTH
    with Engine(tiny_model, config) as again:
        restore_session(again, tmp_path / "s.snap", "copy")
        assert again.wait_idle(timeout=60)
        assert again.calibration()["copy"]["rising"] == live  # window and learning figures as they were
        got = again.call(lambda core: core.prepos.by_session["copy"]["rising"].gate.head)
        assert got is not None and torch.equal(got.proj, head.proj) and torch.equal(got.lags, head.lags)
        assert got.numbers == head.numbers
        learner = again.call(lambda core: core.prepos.by_session["copy"]["rising"].learner)
        assert len(learner.samples) == live["learning"]["samples"] and learner.trained_upto == head_upto(live)
        assert learner.control is not None and torch.equal(learner.control.lags, live_control.lags)  # the control too

    # `streamllm tune --from-live` makes it an adapter: a new engine answers with it from the start.
    from streamllm.cli.tune import main as tune_main
    from streamllm.model.adapter import load_adapter

    assert tune_main(["--from-live", str(tmp_path / "s.snap"), "--out", str(tmp_path / "adapter")]) == 0
    (shipped,) = load_adapter(tmp_path / "adapter").heads
    assert shipped.question_id == "rising" and torch.equal(shipped.proj, head.proj)
    assert shipped.numbers == NUMBER_WIDTH
    with Engine(tiny_model, config, adapter=tmp_path / "adapter") as served:
        served.open_session("s")
        served.register("s", parse_question(QUESTION))
        st = served.call(lambda core: core.prepos.by_session["s"]["rising"])
        assert st.learner is None and torch.equal(st.gate.head.lags, head.lags)  # its own head: nothing to learn
        # Fed the same lines, it reads the same states and numbers: the learned engine's answer, as sure.
        for i, up in enumerate(truth[:60] + [True]):
            served.push("s", [_line(i, up)], truths={"rising": "yes" if up else "no"})
        assert served.wait_idle(timeout=60)
        got = served.standing("s")[0]
        assert got.text == learned_answer.text
        assert got.confidence == pytest.approx(learned_answer.confidence, rel=1e-3, abs=1e-3)


def head_upto(figures: dict) -> int:
    return figures["learning"]["trained_upto"]


def test_learn_says_whether_a_question_learns_and_needs_a_label(tiny_model) -> None:
    from streamllm.config import ConfigError

    with pytest.raises(ConfigError, match=r"learn.*learns from its label"):
        parse_question({"id": "q", "text": "Up?", "choices": ["yes", "no"], "learn": True})
    with pytest.raises(ConfigError, match=r"learn.*true or false"):
        parse_question({**QUESTION, "learn": "yes"})
    never = parse_question({**QUESTION, "id": "never", "learn": False})
    assert parse_question(never.to_dict()) == never  # kept through logs and snapshots
    with Engine(tiny_model, EngineConfig(max_cells=4096, max_context=1024)) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        engine.register("s", never)
        engine.register("s", parse_question({"id": "free", "text": "Say something."}))
        learners = engine.call(lambda core: {q: st.learner is not None
                                             for q, st in core.prepos.by_session["s"].items()})
    assert learners == {"rising": True, "never": False, "free": False}


def test_a_fit_keeps_to_its_time_budget() -> None:
    from streamllm.model.seriesfit import EVAL_EVERY, Samples, fit_series

    gen = torch.Generator().manual_seed(0)
    lines, labels = torch.randn(200, 8, generator=gen), torch.randint(0, 2, (200,), generator=gen)
    index = torch.stack([torch.arange(i - 3, i + 1).clamp_min(0) for i in range(200)])
    whole = Samples(lines, index, labels, torch.full((200,), 4), torch.zeros(200, dtype=torch.long))
    train, dev = whole.subset(torch.arange(160)), whole.subset(torch.arange(160, 200))
    assert fit_series(train, dev, 2, k=4, rank=2, grid=(1e-2,), steps=200).steps == 200
    assert fit_series(train, dev, 2, k=4, rank=2, grid=(1e-2,), steps=200, budget_s=1e-9).steps == EVAL_EVERY
    # The budget counts the given clock: a fit that waited (its clock, CPU time, still) takes every step.
    assert fit_series(train, dev, 2, k=4, rank=2, grid=(1e-2,), steps=200, budget_s=1e-9,
                      clock=lambda: 0.0).steps == 200
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        LearnConfig(budget_s=0)


def test_a_head_reads_as_many_lines_as_its_label_looks_back(tiny_model) -> None:
    # close > ema(close, 12) rests on 24 bars (98% of its weights): 4 lines cannot show it, so its head reads 24
    # (up to max_lines);
    # trend_up(n=1) (one bar back) keeps the configured 4.
    config = EngineConfig(max_cells=8192, max_context=4096,
                          learning=LearnConfig(lines=4, max_lines=10, min_samples=32, every=1000, steps=60))
    assert config.learning.lines_for(parse_question(QUESTION).label) == 4
    slow = {**QUESTION, "id": "above", "label": "close > ema(close, 12)"}
    assert config.learning.lines_for(parse_question(slow).label) == 10  # capped at max_lines
    assert LearnConfig(lines=4).lines_for(parse_question(slow).label) == 24
    with pytest.raises(ValueError, match="max_lines"):
        LearnConfig(lines=20, max_lines=10)
    truth = [bool((i * 7919) % 11 % 2) for i in range(60)]
    with Engine(tiny_model, config) as engine:
        engine.open_session("s")
        engine.register("s", parse_question(QUESTION))
        engine.register("s", parse_question(slow))
        for i, up in enumerate(truth):
            engine.push("s", [_line(i, up)], truths={"rising": "yes" if up else "no", "above": "yes" if up else "no"})
            assert engine.wait_idle(timeout=60)
        deadline = time.monotonic() + 60
        while engine.call(lambda core: core.prepos.by_session["s"]["above"].learner.fits) < 1:
            assert time.monotonic() < deadline, engine.calibration()
            time.sleep(0.05)
        heads = engine.call(lambda core: {q: st.gate.head for q, st in core.prepos.by_session["s"].items()})
        kept = engine.call(lambda core: core.sessions["s"].taps.keep)
    assert heads["above"].lines == 10 and kept == 10 + LINE_SLACK  # grown from 4 + LINE_SLACK for it
    assert heads["rising"] is None or heads["rising"].lines == 4
