"""`streamllm tune --method head` and choice heads in the engine, on the tiny model."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import pytest
import torch

from streamllm.cli.calibrate import parser as calibrate_parser
from streamllm.cli.tune import main as cli_main
from streamllm.config import labels as labels_module
from streamllm.config import load_config, parse_config
from streamllm.durability.snapshot import SnapshotError, restore_session, save_session
from streamllm.engine import CompactionPolicy, Engine, EngineConfig
from streamllm.evaluation.calibrate import calibrate
from streamllm.evaluation.report import to_json
from streamllm.model.adapter import (
    AdapterError,
    ChoiceHead,
    SeriesHead,
    load_adapter,
    pick_adapter,
    save_heads,
)
from streamllm.tuning.data import plan_windows
from streamllm.tuning.extract import StateExtractor, render_window
from streamllm.tuning.headfit import calibrate_threshold, fit_head, judge

CONFIG = """
[[sessions]]
name = "test"
instrument = "TEST"
max_context_tokens = 4096
system_prompt = "You watch 1-minute bars for {instrument}."

[[sessions.questions]]
id = "trend"
text = "Is the price going up or down over the last 5 bars?"
choices = ["up", "down"]
label = "trend_up(n=5)"

[[sessions.questions]]
id = "sma"
text = "Is the last close above the average close of the last 8 bars?"
choices = ["yes", "no"]
label = "above_sma(n=8)"

[[sessions.questions]]
id = "free"
text = "What is the last close?"
"""


def write_bars(path: Path, rows: int) -> Path:
    lines = ["timestamp,open,high,low,close,volume"]
    close, t0 = 100.0, dt.datetime(2024, 1, 2, 10, 0)
    for i in range(rows):
        step = (3.0 if (i // 4) % 2 == 0 else -2.0) + (i % 3 - 1) * 0.5  # zig-zag: both answers occur
        open_, close = close, close + step
        ts = (t0 + dt.timedelta(minutes=i)).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{ts},{open_:.1f},{max(open_, close) + 0.5:.1f},{min(open_, close) - 0.5:.1f},"
                     f"{close:.1f},{1000 + 37 * (i % 7)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_yahoo(path: Path, rows: int) -> Path:
    """write_bars' bars as Yahoo writes daily CSVs: one a day from 1999-01-04, month-first dates, Adj Close."""
    bars_ = write_bars(path.with_name(path.stem + "-minutes.csv"), rows).read_text().splitlines()[1:]
    day0 = dt.date(1999, 1, 4)
    path.write_text("Date,Open,High,Low,Close,Adj Close,Volume\n" + "\n".join(
        f"{(d := day0 + dt.timedelta(days=i)).month}/{d.day}/{d.year},{','.join(r.split(',')[1:5])},"
        f"{r.split(',')[4]},{r.split(',')[5]}" for i, r in enumerate(bars_)) + "\n")
    return path


def random_heads(spec, hidden: int, threshold: float = 0.0, seed: int = 0) -> list[ChoiceHead]:
    g = torch.Generator().manual_seed(seed)
    return [ChoiceHead(q.id, q.text, q.choices, torch.randn(2, hidden, generator=g), torch.randn(2, generator=g),
                       threshold) for q in spec.questions if q.label is not None]


LAYER, LINES = 1, 6  # series heads on the tiny model: its first layer's residual, the last 6 lines


def random_series(spec, hidden: int, threshold: float = 0.0, rank: int = 3, seed: int = 0,
                  words: tuple[int | str, ...] = ()) -> list[SeriesHead]:
    g = torch.Generator().manual_seed(seed)
    width = (2 + len(words)) * hidden
    return [SeriesHead(q.id, q.text, q.choices, LAYER, torch.randn(rank, width, generator=g) * 0.05,
                       torch.randn(rank, generator=g), torch.randn(2, LINES, 2 * rank, generator=g),
                       torch.randn(2, generator=g), threshold, words) for q in spec.questions if q.label is not None]


def engine_with(tiny_model, adapter=None, max_context: int = 2048, *, head_entries: bool = True,
                compact_early: float = 2.0) -> Engine:
    config = EngineConfig(max_cells=8192, max_context=max_context, head_entries=head_entries,
                          compaction=CompactionPolicy(safety=compact_early))
    return Engine(tiny_model, config, adapter=adapter)


def test_training_prompt_and_state_are_the_engines_entry(tiny_model, spec, bars, tmp_path):
    """The head is trained on exactly what it reads when serving: same tokens, same hidden state."""
    labelled = [q for q in spec.questions if q.label is not None]
    extractor = StateExtractor(tiny_model, spec, labelled)
    states = extractor.extract(bars[:20], stride=1)
    save_heads(tmp_path / "ad", random_heads(spec, tiny_model.config.hidden_size), model=tiny_model.name)
    engine = engine_with(tiny_model, tmp_path / "ad")
    try:
        engine.open_session("test", system=spec.system_prompt)
        for q in labelled:
            engine.register("test", q)
        lines = render_window(bars[:20])
        for upto, batch in ((9, lines[:10]), (14, lines[10:15])):  # two pushes: batching changes nothing
            engine.push("test", batch)
            engine.wait_idle()
            for q in labelled:
                st = engine.prepos.find("test", q.id)
                entry_ids = st.session.token_ids[: st.ready.base_len] + st.ready.prompt_ids
                assert entry_ids == extractor.decision_prompt(lines, upto, q)
                row = states.bars[q.id].tolist().index(upto)
                torch.testing.assert_close(st.ready_hidden, states.features[q.id][row], atol=1e-5, rtol=1e-5)
    finally:
        engine.shutdown()


def test_labels_follow_the_bars_and_history(tiny_model, spec, bars):
    extractor = StateExtractor(tiny_model, spec, [q for q in spec.questions if q.label is not None])
    states = extractor.extract(bars[:30], stride=3)
    assert states.bars["trend"].tolist() == list(range(7, 30, 3))  # first = longest history (8) - 1
    for q in (q for q in spec.questions if q.label is not None):
        expected = [q.choices.index(q.expected_answer(bars[: i + 1])) for i in states.bars[q.id].tolist()]
        assert states.labels[q.id].tolist() == expected
        assert states.features[q.id].shape == (len(expected), tiny_model.config.hidden_size)


def test_the_gate_decides_from_the_head(tiny_model, spec, bars, tmp_path):
    heads = random_heads(spec, tiny_model.config.hidden_size, threshold=0.0)
    heads[1].threshold = math.inf  # sma: never confident enough
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    engine = engine_with(tiny_model, tmp_path / "ad")
    try:
        engine.open_session("test", system=spec.system_prompt)
        for q in spec.questions:
            engine.register("test", q)
        engine.push("test", render_window(bars[:12]))
        engine.wait_idle()
        trend = engine.prepos.find("test", "trend")
        scores = heads[0].logits(trend.ready_hidden)
        answer = engine.ask("test", "trend")
        assert answer.path == "fast" and answer.text == ("up", "down")[int(scores.argmax())]
        assert answer.confidence == pytest.approx(float(scores.max() - scores.min()), abs=1e-5)
        sma = engine.prepos.find("test", "sma")
        choice = ("yes", "no")[int(heads[1].logits(sma.ready_hidden).argmax())]
        answer = engine.ask("test", "sma")
        assert answer.path == "entry"  # the head is never confident enough: the gate stays closed,
        assert answer.text == choice and answer.tokens_computed == 0  # yet the head's choice is the answer
        assert engine.prepos.find("test", "free").gate.head is None  # no head for the free question
    finally:
        engine.shutdown()


def test_no_answer_path_calls_a_label(tiny_model, spec, bars, tmp_path, monkeypatch):
    """Labels teach and judge; answering (fast, entry, cold, standing pushes) never reads one."""
    save_heads(tmp_path / "ad", random_heads(spec, tiny_model.config.hidden_size, threshold=0.5), model=tiny_model.name)
    save_heads(tmp_path / "series", random_series(spec, tiny_model.config.hidden_size, threshold=0.5),
               model=tiny_model.name)

    def forbidden(*args, **kwargs):
        raise AssertionError("an answer path called a label function")

    for name, definition in labels_module.LABELS.items():
        monkeypatch.setitem(labels_module.LABELS, name, definition.__class__(
            definition.name, definition.doc, definition.params, forbidden))
    for method in ("evaluate", "answer", "evaluate_at", "answer_at", "truths"):
        monkeypatch.setattr(labels_module.LabelSpec, method, forbidden)
    with pytest.raises(AssertionError):  # the trap is armed
        spec.questions[0].expected_answer(bars)
    for adapter in (None, tmp_path / "ad", tmp_path / "series"):
        engine = engine_with(tiny_model, adapter)
        try:
            engine.open_session("test", system=spec.system_prompt)
            for q in spec.questions:
                engine.register("test", q)
            lines = render_window(bars[:16])
            engine.push("test", lines[:10])
            engine.wait_idle()
            if adapter is not None:  # the head (entry or series) decides, not the LM fallback
                assert engine.prepos.find("test", "trend").ready_hidden is not None
            paths = {engine.ask("test", q.id).path for q in spec.questions}
            engine.push("test", lines[10:])
            paths.add(engine.ask("test", "Is the last bar green?", max_tokens=3).path)
            engine.wait_idle()
            assert "cold" in paths and paths & {"fast", "entry"}
            assert all(st.answer is not None for st in engine.prepos.standing("test"))
        finally:
            engine.shutdown()


def test_snapshots_refuse_another_adapter(tiny_model, spec, bars, tmp_path):
    save_heads(tmp_path / "ad", random_heads(spec, tiny_model.config.hidden_size), model=tiny_model.name)
    engine = engine_with(tiny_model, tmp_path / "ad")
    try:
        engine.open_session("test", system=spec.system_prompt)
        engine.push("test", render_window(bars[:5]))
        engine.wait_idle()
        save_session(engine, "test", tmp_path / "s.safetensors")
    finally:
        engine.shutdown()
    plain = engine_with(tiny_model)
    try:
        with pytest.raises(SnapshotError, match="adapter"):
            restore_session(plain, tmp_path / "s.safetensors")
    finally:
        plain.shutdown()
    again = engine_with(tiny_model, tmp_path / "ad")
    try:
        assert restore_session(again, tmp_path / "s.safetensors").session == "test"
    finally:
        again.shutdown()


def test_adapters_of_another_model_are_refused(tiny_model, spec, tmp_path):
    save_heads(tmp_path / "ad", random_heads(spec, tiny_model.config.hidden_size), model="smollm2-135m")
    with pytest.raises(AdapterError, match="trained on 'smollm2-135m'"):
        engine_with(tiny_model, tmp_path / "ad")
    warnings = []
    assert pick_adapter(None, tmp_path / "ad", "tiny", warn=warnings.append) is None and warnings
    with pytest.raises(AdapterError, match="no head.safetensors"):
        load_adapter(tmp_path / "missing")


def test_config_model_adapter_resolves_against_the_file(tmp_path):
    text = '[model]\nadapter = "adapters/x"\n' + CONFIG
    assert parse_config(text, base_dir=tmp_path).adapter == tmp_path / "adapters" / "x"
    assert parse_config(CONFIG).adapter is None


def test_fit_recovers_a_linear_rule_and_calibrates_its_threshold():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 16, generator=g) * 3 + 1
        return x, (x @ w + 0.3 * torch.randn(n, generator=g) < 0).long()  # class 1 when the score is negative

    (x, y), (xd, yd), (xt, yt) = sample(2000), sample(500), sample(500)
    fit = fit_head(x, y, xd, yd, 2)
    threshold = calibrate_threshold(xd @ fit.weight.T + fit.bias, yd, 0.99)
    result = judge(xt @ fit.weight.T + fit.bias, yt, ("a", "b"), threshold, 0.99)
    assert result["accuracy"] > 0.95 and result["base_rate"] < 0.7
    assert result["precision"] >= 0.97 and 0.5 < result["coverage"] < 1.0
    assert result["ranks"] > 0.98  # the margin orders the truths, as calibrate's ranks column says
    noise = torch.randint(0, 2, (500,), generator=g)
    assert 0.4 < judge(torch.randn(500, 2, generator=g), noise, ("a", "b"), threshold, 0.99)["ranks"] < 0.6
    assert calibrate_threshold(torch.randn(500, 2, generator=g), noise, 0.99) == math.inf  # no signal: closed


def test_probability_quality_tells_honest_probabilities_from_overconfident_ones():
    """ECE: the top choice's probability against how often it was right. Logits saying ~1.0 for
    answers right 75% of the time are off by ~0.25; the same answers at p = 0.75 are honest."""
    from streamllm.tuning.headfit import probability_quality

    g = torch.Generator().manual_seed(0)
    n = 2000
    pred = torch.randint(0, 2, (n,), generator=g)
    y = torch.where(torch.rand(n, generator=g) < 0.75, pred, 1 - pred)
    sure = torch.nn.functional.one_hot(pred, 2).float() * 10.0  # margin 10: p(top) = 0.99995
    over = probability_quality(sure, y)
    assert over["mean_top_probability"] > 0.99 and over["ece"] == pytest.approx(0.25, abs=0.03)
    honest = probability_quality(sure * math.log(3) / 10, y)  # softmax margin ln 3: p(top) = 0.75
    assert honest["mean_top_probability"] == pytest.approx(0.75, abs=1e-4) and honest["ece"] < 0.03
    assert honest["log_loss"] < over["log_loss"]


def test_windows_never_straddle_the_split():
    import random

    plans = plan_windows("f", 1000, 50, {"train": 99, "dev": 99, "later": 99}, random.Random(0))
    ranges = {"train": (0, 700), "dev": (700, 800), "later": (800, 1000)}
    for p in plans:
        lo, hi = ranges[p.set]
        assert lo <= p.start and p.start + p.bars <= hi
    assert sum(p.set == "train" for p in plans) == 14 and sum(p.set == "later" for p in plans) == 4


def test_tune_writes_heads_and_card_and_resumes(tiny_model, tmp_path, monkeypatch):
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    data = write_bars(tmp_path / "bars.csv", 600)
    argv = ["--questions", str(config), "--data", str(data), "--out", str(tmp_path / "out"), "--model", "tiny",
            "--method", "head", "--window", "40", "--stride", "2", "--train-windows", "6", "--dev-windows", "2", "--later-windows", "2",
            "--synthetic-bars", "0", "--no-progress", "--target-precision", "0.8", "--no-cache"]
    assert cli_main(argv) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    assert card["method"] == "head" and set(card["questions"]) == {"trend", "sma"} and card["changes"] == "price"
    # windows x decision points (every 2nd bar whose label is known: trend from bar 5, sma from bar 7)
    assert card["decision_points"]["train"] == 6 * (18 + 17)
    later = card["questions"]["trend"]["judged"]["later"]
    assert later["samples"] == 2 * 18 and 0 <= later["accuracy"] <= 1 and "coverage_at_target" in later
    adapter = load_adapter(tmp_path / "out")
    assert [h.question_id for h in adapter.heads] == ["trend", "sma"] and adapter.model == "tiny"
    assert (tmp_path / "out" / "card.md").read_text().startswith("# Choice heads")
    first = card["extract_minutes_all_windows"]
    assert first > 0 and card["windows_untimed"] == 0
    assert len(list((tmp_path / "out" / "states").glob("*/window-*.safetensors"))) == 9  # 6 + 1 + 2, under OUT/states
    assert cli_main([*argv, "--resume"]) == 0  # every window comes from its checkpoint
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    # a resumed card still says what extracting every window cost, from the checkpoints' own times
    assert card["tokens_extracted"] == 0 and card["extract_minutes_all_windows"] == first
    assert f"{first} min extracting" in (tmp_path / "out" / "card.md").read_text()
    # Lines in basis points are other states: a resume under the changed config extracts them anew.
    config.write_text(CONFIG.replace('system_prompt = "You watch 1-minute bars for {instrument}."\n', BP_RENDER))
    assert cli_main([*argv, "--resume"]) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    assert card["tokens_extracted"] == card["tokens_all_windows"] > 0 and card["changes"] == "bp"
    assert load_adapter(tmp_path / "out").changes == "bp"
    assert cli_main(argv) == 0  # without --resume, --no-cache extracts every window again
    assert json.loads((tmp_path / "out" / "card.json").read_text())["tokens_extracted"] > 0


def test_a_spent_budget_keeps_every_judged_window_and_one_train_window(tiny_model, tmp_path, monkeypatch):
    """--minutes cuts training windows only, and the judged windows are extracted before any of them,
    so the budget is the whole run's (judged windows last once doubled a 3-minute budget)."""
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    argv = ["--questions", str(config), "--data", str(write_bars(tmp_path / "bars.csv", 600)), "--out", str(out),
            "--model", "tiny", "--method", "head", "--window", "40", "--stride", "2", "--train-windows", "6",
            "--dev-windows", "2", "--later-windows", "2", "--synthetic-bars", "80", "--no-progress",
            "--minutes", "0.0001", "--no-cache"]
    assert cli_main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    assert len(card["windows"]["train"]) == 1  # spent at once: the one window a head needs
    assert [len(card["windows"][s]) for s in ("dev", "later", "synthetic")] == [1, 2, 3]  # all there are
    written = [json.loads(f.read_text()) for f in sorted((out / "states").glob("*/window-*.json"),
                                                         key=lambda f: f.stat().st_mtime_ns)]
    sets = ["synthetic" if w["source"].startswith("synthetic") else
            "train" if w["start"] < 420 else "dev" if w["start"] < 480 else "later" for w in written]  # 70% | 10% | 20%
    assert sets == ["dev", "later", "later", *["synthetic"] * 3, "train"]


def test_calibrate_with_an_adapter_reports_the_target_keys(tiny_model, tmp_path):
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    spec = load_config(config).sessions[0]
    save_heads(tmp_path / "ad", random_heads(spec, tiny_model.config.hidden_size), model=tiny_model.name)
    args = calibrate_parser().parse_args(["--questions", str(config), "--data", str(write_bars(tmp_path / "b.csv", 80)),
                                          "--model", "tiny", "--no-progress", "--adapter", str(tmp_path / "ad"),
                                          "--start", "20", "--bars", "50"])
    run, reports, meta = calibrate(args, model=tiny_model)
    out = to_json(run, reports, meta)
    assert meta["adapter_id"] == load_adapter(tmp_path / "ad").id and run.updates == 50 - 8 + 1
    for q in ("trend", "sma"):
        for key in ("coverage_at_target", "precision_at_target", "accuracy", "base_rate"):
            assert f"{key}.{q}" in out
        assert out[f"ranking.{q}"] is None or 0 <= out[f"ranking.{q}"] <= 1
        assert 0 <= out[f"bias_accuracy.{q}"] <= 1
    assert out["min_coverage_at_target"] == min(out["coverage_at_target.trend"], out["coverage_at_target.sma"])
    # How sure: block-bootstrap intervals (blocks of each label's history: 43 bars give sma's 10-bar label
    # 5 blocks; the weakest question's blocks are the longest label's).
    for q in ("trend", "sma"):
        lo, hi = out[f"accuracy_interval.{q}"]
        assert 0 <= lo <= out[f"accuracy.{q}"] <= hi <= 1
        lo, hi = out[f"coverage_at_target_interval.{q}"]
        assert 0 <= lo <= hi <= 1
    lo, hi = out["min_coverage_at_target_interval"]
    assert lo <= hi <= max(out["coverage_at_target_interval.trend"][1], out["coverage_at_target_interval.sma"][1])
    assert out["interval_level"] == 0.9


def _mix_run(tiny_model, tmp_path, monkeypatch, other_bars):
    """tune's arguments for 600 bars of --data (windows of 40: 3 train, 2 dev, 2 later) on the tiny model,
    and a second table of `other_bars` bars to --mix."""
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    data, other = write_bars(tmp_path / "bars.csv", 600), write_bars(tmp_path / "other.csv", other_bars)
    argv = ["--questions", str(config), "--data", str(data), "--out", str(tmp_path / "out"), "--model", "tiny",
            "--method", "head", "--window", "40", "--stride", "4", "--train-windows", "3", "--dev-windows", "2",
            "--later-windows", "2", "--synthetic-bars", "0", "--no-progress"]
    return argv, data, other


def test_mix_adds_training_windows_only(tiny_model, tmp_path, monkeypatch):
    """--mix sources train the heads and are never judged on: dev and later stay --data's own ranges."""
    argv, data, other = _mix_run(tiny_model, tmp_path, monkeypatch, other_bars=300)
    assert cli_main([*argv, "--mix", str(other), "--mix-windows", "7"]) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    mixed = {s: sum("other.csv" in w for w in card["windows"][s]) for s in ("train", "dev", "later")}
    assert mixed == {"train": 7, "dev": 0, "later": 0}  # all 7 windows of 40 in 300 bars: the whole file, not 70%
    assert len(card["windows"]["train"]) == 3 + 7 and len(card["windows"]["later"]) == 2
    assert card["mix"] == [str(other)] and f"(training also on {other})" in (tmp_path / "out" / "card.md").read_text()
    assert cli_main([*argv, "--mix", str(data)]) == 2  # a source in both is refused
    assert cli_main([*argv, "--mix", "synthetic:3", "--mix-windows", "1"]) == 0  # every instrument it has
    mixed = [w for w in json.loads((tmp_path / "out" / "card.json").read_text())["windows"]["train"] if "synthetic" in w]
    assert len(mixed) == 3 and all("synthetic-3_" in w for w in mixed)
    # --mix-as: --data's training range only (70% of 600 bars: 10 windows of 40), never its dev or later bars.
    assert cli_main([*argv, "--mix-as", "price=0.01", "--mix-windows", "99"]) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    scaled = [w for w in card["windows"]["train"] if "@x0.01" in w]
    assert len(scaled) == 10 and max(int(w.split("-")[-2]) for w in scaled) == 360
    assert not any("@" in w for s in ("dev", "later") for w in card["windows"][s])


@pytest.mark.parametrize("method", ["head", "series"])
def test_a_variant_for_one_question_trains_that_head_alone(tiny_model, tmp_path, monkeypatch, capsys, method):
    """--mix-as ...,for=ID: the variant's windows train the named question's head; every other head is
    the one trained without the variant, to the bit (same samples, same fit)."""
    argv, _, _ = _mix_run(tiny_model, tmp_path, monkeypatch, other_bars=0)
    argv[argv.index("head")] = method
    # series: one fit per candidate, over [mean, last] alone (--words ''): which head a variant trains is the point
    argv += ["--mix-windows", "3"] + (["--fit-orders", "1", "--lines", "10", "--tap-layer", "1", "--words", ""]
                                      if method == "series" else [])

    def heads():
        card = json.loads((tmp_path / "out" / "card.json").read_text())
        return card, {h.question_id: h for h in load_adapter(tmp_path / "out").heads}

    assert cli_main(argv) == 0
    alone, plain = heads()
    assert cli_main([*argv, "--mix-as", "price=0.01,for=sma"]) == 0
    card, only = heads()
    assert card["mix"] == ["--data as x0.01 for sma"]
    runs = [("alone", alone), ("only", card)]
    if method == "head":  # the variant for every question (a series fit is slower: the head run checks it)
        assert cli_main([*argv, "--mix-as", "price=0.01"]) == 0
        runs.append(("taught", heads()[0]))
    samples = {q: {c: x["questions"][q]["train_samples"] for c, x in runs} for q in ("trend", "sma")}
    assert samples["sma"]["only"] > samples["sma"]["alone"]
    assert samples["trend"]["only"] == samples["trend"]["alone"]
    if method == "head":
        assert samples["sma"]["only"] == samples["sma"]["taught"] and samples["trend"]["taught"] > samples["trend"]["only"]
    for name in ("weight", "bias") if method == "head" else ("proj", "lags", "bias"):
        assert torch.equal(getattr(only["trend"], name), getattr(plain["trend"], name))
        assert not torch.equal(getattr(only["sma"], name), getattr(plain["sma"], name))
    capsys.readouterr()
    assert cli_main([*argv, "--mix-as", "price=0.01,for=sma+nope"]) == 2
    assert "for=nope is not a labelled question of the config (labelled: sma, trend)" in capsys.readouterr().err
    assert cli_main([*argv, "--mix-as", "price=0.01,for=sma", "price=0.01,for=trend"]) == 2
    assert "2 variants show the same bars (x0.01); name every question in one for=ID+ID" in capsys.readouterr().err
    for bad in ("price=0.01,for=", "price=0.01,for=sma+"):
        with pytest.raises(SystemExit):
            cli_main([*argv, "--mix-as", bad])
    assert "--mix-as 'price=0.01,for=sma+': write price=X" in capsys.readouterr().err


def test_mix_dev_windows_judge_the_mixed_market_apart_from_its_training_windows(tiny_model, tmp_path, monkeypatch,
                                                                                 capsys):
    """--mix-dev-windows: a --mix table gives dev windows too, none overlapping or touching one of its
    training windows; the card reports the dev set per market."""
    argv, _, other = _mix_run(tiny_model, tmp_path, monkeypatch, other_bars=800)
    argv += ["--mix", str(other), "--mix-windows", "5"]
    assert cli_main([*argv, "--mix-dev-windows", "3"]) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    slots = {s: [int(w.split("-")[-2]) // 40 for w in card["windows"][s] if "other.csv" in w] for s in ("train", "dev")}
    assert len(slots["train"]) == 5 and len(slots["dev"]) == 3 and not any("other.csv" in w for w in card["windows"]["later"])
    assert all(abs(d - t) > 1 for d in slots["dev"] for t in slots["train"])
    judged = next(iter(card["questions"].values()))["judged"]
    assert {"dev", "dev/bars.csv", "dev/other.csv"} <= set(judged)
    assert judged["dev"]["samples"] == judged["dev/bars.csv"]["samples"] + judged["dev/other.csv"]["samples"]
    assert cli_main([*argv, "--mix-dev-windows", "3"]) == 0  # the same windows again: drawn from the seed
    again = json.loads((tmp_path / "out" / "card.json").read_text())
    assert again["windows"] == card["windows"]
    argv[argv.index(str(other))] = "synthetic:3"  # a synthetic market trains only: said, not silently nothing
    capsys.readouterr()
    assert cli_main([*argv, "--mix-dev-windows", "1", "--fit-orders", "1"]) == 0
    assert "no --mix table to draw them from" in capsys.readouterr().err
    assert cli_main([*argv, "--mix-dev-windows", "-1"]) == 2


def test_judged_sources_are_spread_over_and_reported_each(tiny_model, tmp_path, monkeypatch):
    """--judge-windows spreads windows over a long judged file; the card pools every other market under
    "other" and shows each on its own, so a pooled figure cannot hide one market."""
    import streamllm.model.loader as loader
    from streamllm.tuning.data import spread

    assert spread(1000, 150, 4) == [0, 300, 450, 750] and spread(1000, 150, 1) == [0]
    assert spread(100, 150, 4) == [0] and spread(450, 150, 9) == [0, 150, 300]  # no more windows than fit
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    data = write_bars(tmp_path / "bars.csv", 600)
    hourly, daily = write_bars(tmp_path / "hourly.csv", 200), write_bars(tmp_path / "daily.csv", 60)
    argv = ["--questions", str(config), "--data", str(data), "--out", str(tmp_path / "out"), "--model", "tiny",
            "--method", "head", "--window", "40", "--stride", "4", "--train-windows", "3", "--dev-windows", "1",
            "--later-windows", "1", "--synthetic-bars", "0", "--no-progress", "--judge", str(hourly), str(daily),
            "--judge-windows", "3", "--judge-bars", "30"]
    assert cli_main(argv) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    starts = sorted(w.split("-")[-2] for w in card["windows"]["other"] if "hourly" in w)
    assert starts == ["0", "150", "60"] and sum("daily" in w for w in card["windows"]["other"]) == 2
    judged = card["questions"]["trend"]["judged"]
    assert judged["other/hourly.csv"]["samples"] + judged["other/daily.csv"]["samples"] == judged["other"]["samples"]
    assert card["decision_points"]["other"] == card["decision_points"]["other/hourly.csv"] + card["decision_points"][
        "other/daily.csv"]
    assert "| trend | other/daily.csv |" in (tmp_path / "out" / "card.md").read_text()
    assert cli_main([*argv, "--judge-windows", "0"]) == 2


def test_tables_with_month_first_dates_are_judged_with_time_format(tiny_model, tmp_path, monkeypatch, capsys):
    """Yahoo's daily CSVs write 1/4/1999: tune refuses to guess and reads them with --judge-time-format
    (--time-format for --data and --mix), each set of files in its own format."""
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    yahoo = write_yahoo(tmp_path / "sp500.csv", 60)
    argv = ["--questions", str(config), "--data", str(write_bars(tmp_path / "bars.csv", 600)), "--out",
            str(tmp_path / "out"), "--model", "tiny", "--method", "head", "--window", "40", "--stride", "4",
            "--train-windows", "2", "--dev-windows", "1", "--later-windows", "1", "--synthetic-bars", "0",
            "--no-progress", "--judge", str(yahoo)]
    assert cli_main(argv) == 2
    assert "pass --time-format '%m/%d/%Y'" in capsys.readouterr().err
    assert cli_main([*argv, "--judge-time-format", "%m/%d/%Y"]) == 0
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    assert card["questions"]["trend"]["judged"]["other"]["samples"] > 0


def test_mix_tables_cut_to_a_time_range_beside_iso_bars(tiny_model, tmp_path, monkeypatch, capsys):
    """--mix PATH@FROM..TO trains on that range of a table only (a market's years disjoint from a judged
    one's); --time-format for month-first tables leaves ISO tables of the same flag as they read; a mix
    table draws its windows from its own seed, so adding one moves no other window (nor its states)."""
    import streamllm.model.loader as loader
    from streamllm.tuning.data import TuneError, time_range

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    yahoo = write_yahoo(tmp_path / "sp500.csv", 300)  # 1999-01-04 .. 1999-10-30
    argv = ["--questions", str(config), "--data", str(write_bars(tmp_path / "bars.csv", 600)), "--out",
            str(tmp_path / "out"), "--model", "tiny", "--method", "head", "--window", "40", "--stride", "4",
            "--train-windows", "2", "--dev-windows", "1", "--later-windows", "1", "--synthetic-bars", "0",
            "--no-progress", "--mix-windows", "9", "--time-format", "%m/%d/%Y"]
    assert cli_main([*argv, "--mix", "synthetic:3"]) == 0
    before = json.loads((tmp_path / "out" / "card.json").read_text())["windows"]["train"]
    assert cli_main([*argv, "--mix", "synthetic:3", f"{yahoo}@1999-08-01.."]) == 0
    after = json.loads((tmp_path / "out" / "card.json").read_text())["windows"]["train"]
    cut = [w for w in after if "sp500" in w]
    assert set(after) - set(cut) == set(before)  # every other window where it was
    assert len(cut) == 2 and all("sp500.csv@1999-08-01.." in w for w in cut)  # 91 days: 2 windows of 40
    assert time_range("a.csv") == ("a.csv", -(2**63), 2**63 - 1)
    assert time_range("a.csv@..1970-01-02")[1:] == (-(2**63), 86_400 * 10**9)
    assert time_range("a.csv@1970-01-01T01:00+01:00..")[1] == 0
    for bad in ("a.csv@2020-13-01..", "a.csv@2020-01-02..2020-01-01"):
        with pytest.raises(TuneError, match="a.csv@"):
            time_range(bad)
    assert cli_main([*argv, "--mix", f"{yahoo}@2001-01-01.."]) == 2
    assert "no bar in that range (the file holds 1999-01-04 to 1999-10-30)" in capsys.readouterr().err


def test_mix_as_shows_the_training_range_as_other_markets(tmp_path):
    """--mix-as variants: another price level leaves every label as it was (labels compare prices);
    merged bars are the OHLCV of their run; restamped bars are one dated line per day."""
    from feeds.sources import TableSource
    from streamllm.config.labels import parse_label
    from streamllm.feeding.render import render_lines
    from streamllm.tuning.data import TuneError, Variant

    bars_ = TableSource(write_bars(tmp_path / "b.csv", 120), "bar").events()
    level = Variant.parse("price=0.0003").apply(bars_)
    assert level[5].close == pytest.approx(bars_[5].close * 0.0003) and level[5].px_dp == 7  # ~0.0324: 6 significant digits
    for text in ("trend_up(n=10)", "above_sma(n=20)", "volatility_rising(n=10)", "volume_spike(k=3, n=20)"):
        label = parse_label(text)
        assert [label.evaluate(level[:i]) for i in range(1, 121)] == [label.evaluate(bars_[:i]) for i in range(1, 121)]
    daily = Variant.parse("price=2,bars=4,every=86400").apply(bars_)
    assert len(daily) == 30 and str(Variant.parse("price=2,bars=4,every=86400")) == "x2-4bars-86400s"
    run = bars_[8:12]
    d = daily[2]
    assert (d.open, d.high, d.low, d.close, d.volume) == pytest.approx(
        (2 * run[0].open, 2 * max(b.high for b in run), 2 * min(b.low for b in run), 2 * run[-1].close,
         sum(b.volume for b in run)))
    assert d.ts_open == daily[0].ts_open + 2 * 86_400 * 10**9 and d.interval_ns == 86_400 * 10**9
    assert all("T" in line.split()[0] for line in render_lines(daily))  # each line a new day: dated
    # Another size unit: every volume label is a ratio of volumes, so it stays; the lines show other units.
    thousandth = Variant.parse("volume=0.001")
    small = thousandth.apply(bars_)
    assert str(thousandth) == "x1-vol0.001" and small[7].volume == pytest.approx(bars_[7].volume * 0.001)
    assert small[7].buy_volume == pytest.approx(bars_[7].buy_volume * 0.001, nan_ok=True)
    spike = parse_label("volume_spike(k=3, n=20)")
    assert [spike.evaluate(small[:i]) for i in range(1, 121)] == [spike.evaluate(bars_[:i]) for i in range(1, 121)]
    assert [line.split(" v")[1] for line in render_lines(small[:3])] != [
        line.split(" v")[1] for line in render_lines(bars_[:3])]
    for bad in ("price=0", "cost=1", "bars=0", "price=abc", "price=1,bars=2.5", "volume=0", "volume=inf"):
        with pytest.raises(TuneError, match="--mix-as"):
            Variant.parse(bad)


def test_windows_over_the_context_are_caught_before_extraction(tiny_model, tmp_path):
    """A --mix window whose lines are longer is trimmed to the bars that fit; a --data window over the
    session's context is an error naming it, raised before anything is extracted (not 20 minutes in)."""
    import argparse

    from feeds.sources import TableSource
    from streamllm.tuning.data import Task, TuneError, WindowPlan
    from streamllm.tuning.tune import _fitted

    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    spec = load_config(config).sessions[0]
    bars = TableSource(write_bars(tmp_path / "b.csv", 80), "bar", instrument="TEST").events()
    labelled = [q for q in spec.questions if q.label is not None]
    extractor = StateExtractor(tiny_model, spec, labelled, max_window_tokens=400)
    task = Task(spec, labelled, {"b": bars}, [], extractor=extractor)
    args = argparse.Namespace(lines=10, method="series")
    ids, ends = extractor.session_ids(render_window(bars[:60]))
    assert len(ids) > 400  # the window does not fit
    trimmed = _fitted(task, WindowPlan("train", "b", 0, 60, mixed=True), args)
    assert trimmed is not None and trimmed.bars == sum(e <= 400 for e in ends) < 60 and trimmed.mixed
    assert len(extractor.session_ids(render_window(bars[:trimmed.bars]))[0]) <= 400
    with pytest.raises(TuneError, match=r"train window train-b-0-60: 60 bars are \d+ tokens, over the session's 400"):
        _fitted(task, WindowPlan("train", "b", 0, 60), args)
    assert _fitted(task, WindowPlan("dev", "b", 0, 10), args) == WindowPlan("dev", "b", 0, 10)
    args.lines = 60  # too few bars would fit for the heads' lines: the mixed window is left out
    assert _fitted(task, WindowPlan("train", "b", 0, 60, mixed=True), args) is None


def test_the_base_models_column_reads_the_first_windows_of_each_judged_source():
    """Only those windows branch their decision points (the whole model's pass); every other window of a
    series run is read for its lines alone. --method head reads every window's decision points."""
    import argparse
    from types import SimpleNamespace

    from streamllm.tuning.data import WindowPlan
    from streamllm.tuning.tune import _pointed

    a, b = SimpleNamespace(spec=SimpleNamespace(name="a")), SimpleNamespace(spec=SimpleNamespace(name="b"))
    plans = [WindowPlan("later", "btc", 100 * i, 50) for i in range(3)] + [
        WindowPlan("other", src, 10 * k, 50) for k, src in enumerate(("eurusd", "goog", "eurusd"))] + [
        WindowPlan("synthetic", "synthetic:X", 0, 50), WindowPlan("train", "btc", 0, 50), WindowPlan("dev", "btc", 0, 50)]
    work = [(t, p) for p in plans for t in (a, b)]

    def picked(**kw):
        args = argparse.Namespace(**{"method": "series", "base_model": True, "base_model_windows": 2, **kw})
        return sorted((name, p.set, p.source, p.start) for name, p in _pointed(work, args))

    per_session = [("later", "btc", 0), ("later", "btc", 100), ("other", "eurusd", 0), ("other", "eurusd", 20),
                   ("other", "goog", 10), ("synthetic", "synthetic:X", 0)]
    assert picked() == sorted([("a", *x) for x in per_session] + [("b", *x) for x in per_session])
    assert len(picked(base_model_windows=1)) == 2 * 4  # later, eurusd, goog, synthetic: one each
    assert picked(base_model=False) == [] and picked(base_model_windows=0) == []
    assert len(picked(method="head")) == len(work)


BP_RENDER = 'system_prompt = "You watch 1-minute bars for {instrument}."\n[sessions.render]\nchanges = "bp"\n'


def test_a_session_writing_other_lines_than_the_adapter_learned_is_refused(tiny_model, spec, tmp_path):
    """A head tuned on price-unit lines reads basis points as noise, confidently: refused by name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    heads = random_heads(spec, tiny_model.config.hidden_size)
    save_heads(tmp_path / "price", heads, model=tiny_model.name)
    save_heads(tmp_path / "bp", heads, model=tiny_model.name, changes="bp")
    assert load_adapter(tmp_path / "price").changes == "price" and load_adapter(tmp_path / "bp").changes == "bp"
    as_price = parse_config(CONFIG, source="q.toml")
    as_bp = parse_config(CONFIG.replace('system_prompt = "You watch 1-minute bars for {instrument}."\n', BP_RENDER),
                         source="q.toml")
    assert as_bp.sessions[0].render.changes == "bp"
    with pytest.raises(AdapterError, match=r"q.toml: sessions\[0\].render.changes: .*'bp' lines; .* tuned on 'price'"):
        pick_adapter(tmp_path / "price", None, tiny_model.name, config=as_bp)
    with pytest.raises(AdapterError, match="tuned on 'bp' lines"):
        pick_adapter(None, tmp_path / "bp", tiny_model.name, config=as_price)
    assert pick_adapter(tmp_path / "bp", None, tiny_model.name, config=as_bp).changes == "bp"
    # A session none of whose questions has a head is not the adapter's business.
    untouched = parse_config(CONFIG.replace("Is the price", "Is the mid").replace("Is the last close", "Is the mid")
                             .replace('system_prompt = "You watch 1-minute bars for {instrument}."\n', BP_RENDER))
    assert pick_adapter(tmp_path / "price", None, tiny_model.name, config=untouched) is not None
    # A head file from before the option (no "changes" in its metadata) was tuned on price units.
    path = tmp_path / "price" / "head.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["streamllm"])
    del meta["changes"]
    save_file(load_file(str(path)), str(path), metadata={"streamllm": json.dumps(meta)})
    assert load_adapter(tmp_path / "price").changes == "price"


def test_tune_refuses_sessions_that_write_different_lines(tiny_model, tmp_path, monkeypatch, capsys):
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    second = CONFIG.replace('name = "test"', 'name = "other"').replace(
        'system_prompt = "You watch 1-minute bars for {instrument}."\n', BP_RENDER)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG + second)
    argv = ["--questions", str(config), "--data", str(write_bars(tmp_path / "bars.csv", 300)), "--out",
            str(tmp_path / "out"), "--model", "tiny", "--no-progress"]
    assert cli_main(argv) == 2
    assert "sessions write changes in different units ({'test': 'price', 'other': 'bp'})" in capsys.readouterr().err
    assert not (tmp_path / "out" / "head.safetensors").exists()


def test_tune_takes_every_commands_read_flags():
    """tune reads files with the flags calibrate, serve, inspect and bench replay take (one parser):
    --columns comma-separated and repeatable, an unknown field refused by name, not read as nothing."""
    from streamllm.cli.tune import parser as _parser
    from streamllm.tuning.data import TuneError, read_opts

    base = ["--questions", "q.toml", "--data", "x.csv", "--out", "o"]
    args = _parser().parse_args([*base, "--columns", "ts_event=Date,close=Close", "--columns", "volume=Vol",
                                 "--market", "usdm", "--tz", "America/New_York"])
    opts = read_opts(args, instrument="ES")
    assert dict(opts.columns) == {"ts_event": "Date", "close": "Close", "volume": "Vol"}
    assert (opts.market, opts.tz, opts.instrument) == ("usdm", "America/New_York", "ES")
    assert read_opts(_parser().parse_args(base)).columns == {}
    with pytest.raises(TuneError, match="unknown field 'Close'"):
        read_opts(_parser().parse_args([*base, "--columns", "Close=close"]))
    with pytest.raises(TuneError, match="FIELD=COLUMN"):
        read_opts(_parser().parse_args([*base, "--columns", "ts_event"]))


def _dbn_ohlcv(path: Path, rows: int) -> Path:
    """write_bars' zig-zag as Databento OHLCV-1m, written with databento-dbn's own encoder."""
    dbn = pytest.importorskip("databento_dbn", reason="databento-dbn not installed")
    from types import SimpleNamespace as NS

    t0, px = 1_700_000_040_000_000_000, 1_000_000_000
    day = dt.date(2023, 11, 14)
    meta = dbn.Metadata(dataset="GLBX.MDP3", start=t0, stype_in=dbn.SType.RAW_SYMBOL,
                        stype_out=dbn.SType.INSTRUMENT_ID, schema=dbn.Schema.OHLCV_1M, symbols=["ESZ3"],
                        end=t0 + rows * 60 * 10**9,
                        mappings=[NS(raw_symbol="ESZ3", intervals=[NS(start_date=day, end_date=day + dt.timedelta(days=2),
                                                                      symbol="123")])]).encode()
    recs, close = [], 4500.0
    for i in range(rows):
        step = (3.0 if (i // 4) % 2 == 0 else -2.0) + (i % 3 - 1) * 0.5
        open_, close = close, close + step
        recs.append(dbn.OHLCVMsg(dbn.RType.OHLCV_1M, 1, 123, t0 + i * 60 * 10**9, int(open_ * px),
                                 int((max(open_, close) + 0.5) * px), int((min(open_, close) - 0.5) * px),
                                 int(close * px), 1000 + 37 * (i % 7)))
    path.write_bytes(meta + b"".join(bytes(r) for r in recs))
    return path


def test_tune_reads_dbn_bars_trade_tables_and_mapped_columns(tmp_path):
    """tune's files open as every command's do (feeds.sources.open_source): Databento OHLCV bars, a
    trades table made into bars of the session's interval, a bar table whose columns --columns names;
    a file with nothing to make bars of is refused by name."""
    from feeds.sources import ReadOptions
    from streamllm.tuning.data import TuneError, load_bars

    got = load_bars([str(_dbn_ohlcv(tmp_path / "es.ohlcv-1m.dbn", 50))], opts=ReadOptions(instrument="ES"),
                    bar_seconds=60)
    (bars,) = got.values()
    assert list(got) == ["es.ohlcv-1m.dbn"] and len(bars) == 50 and bars[0].open == 4500.0
    assert bars[0].interval_ns == 60 * 10**9 and bars[-1].ts_open - bars[0].ts_open == 49 * 60 * 10**9
    trades = tmp_path / "trades.csv"
    trades.write_text("timestamp,price,size,side\n" + "".join(
        f"2024-01-02 10:{i // 6:02d}:{i % 6 * 10:02d},{100 + (i % 5) * 0.5},{1 + i % 3},{'buy' if i % 2 else 'sell'}\n"
        for i in range(60)))
    got = load_bars([str(trades)], opts=ReadOptions(instrument="TEST"), bar_seconds=60)
    assert list(got) == ["trades.csv:TEST"] and len(got["trades.csv:TEST"]) == 10
    assert got["trades.csv:TEST"][0].volume == sum(1 + i % 3 for i in range(6))
    halves = load_bars([f"{trades}@..2024-01-02T10:05", f"{trades}@2024-01-02T10:05.."],
                       opts=ReadOptions(instrument="TEST"), bar_seconds=60)
    assert {k: len(v) for k, v in halves.items()} == {"trades.csv@..2024-01-02T10:05:TEST": 5,
                                                      "trades.csv@2024-01-02T10:05..:TEST": 5}
    with pytest.raises(TuneError, match="no trade in that range .the file holds 2024-01-02 to 2024-01-02"):
        load_bars([f"{trades}@2025-01-01.."], opts=ReadOptions(instrument="TEST"), bar_seconds=60)
    odd = tmp_path / "odd.csv"
    odd.write_text("t,o,h,l,c,vol\n" + "".join(f"2024-01-02 10:{i:02d}:00,{100 + i},{101 + i},{99 + i},{100.5 + i},5\n"
                                                for i in range(30)))
    mapped = ReadOptions(instrument="TEST", columns={"ts_event": "t", "open": "o", "high": "h", "low": "l",
                                                      "close": "c", "volume": "vol"})
    assert [b.close for b in load_bars([str(odd)], opts=mapped, bar_seconds=60)["odd.csv"]][:2] == [100.5, 101.5]
    quotes = tmp_path / "quotes.csv"
    quotes.write_text("timestamp,bid,ask,bid_size,ask_size\n2024-01-02 10:00:00,99.5,100.5,1,1\n")
    with pytest.raises(TuneError, match="quotes.csv: no bars or trades to make bars of .it holds quotes"):
        load_bars([str(quotes)], opts=ReadOptions(), bar_seconds=60)


def test_tune_trains_on_a_databento_file(tiny_model, tmp_path, monkeypatch, capsys):
    """--data takes a DBN file end to end: windows cut from its bars, heads written, the card naming it."""
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    dbn_file = _dbn_ohlcv(tmp_path / "es.ohlcv-1m.dbn", 400)
    argv = ["--questions", str(config), "--data", str(dbn_file), "--out", str(tmp_path / "out"), "--model", "tiny",
            "--method", "head", "--window", "40", "--stride", "4", "--train-windows", "2", "--dev-windows", "1",
            "--later-windows", "1", "--synthetic-bars", "0", "--no-progress"]
    assert cli_main(argv) == 0
    # what the file became is said before extraction starts
    assert "streamllm tune: session test: es.ohlcv-1m.dbn: 400 bars of 60 s, 2023-11-14 to 2023-11-15" in (
        capsys.readouterr().err)
    card = json.loads((tmp_path / "out" / "card.json").read_text())
    assert card["data"] == [str(dbn_file)] and card["questions"]["trend"]["judged"]["later"]["samples"] > 0
    assert all("es.ohlcv-1m.dbn" in w for w in card["windows"]["train"])


def test_tune_reads_a_market_below_zero_only_when_told(tmp_path):
    """--signed-prices reaches tune's table reader: WTI's April 2020 bars are training data then."""
    from streamllm.cli.tune import parser as _parser
    from streamllm.tuning.data import load_bars, read_opts

    csv = tmp_path / "cl.csv"
    csv.write_text("Date,Open,High,Low,Close,Volume\n2020-04-17,19.87,20.29,17.31,18.27,100\n"
                   "2020-04-20,17.73,17.85,-40.32,-37.63,247947\n2020-04-21,-14.00,13.86,-16.74,10.01,2288\n")
    base = ["--questions", "q.toml", "--data", str(csv), "--out", "o"]
    got = {flag: load_bars([str(csv)], opts=read_opts(_parser().parse_args([*base, *flag]), instrument="CL"), bar_seconds=60)
           for flag in ((), ("--signed-prices",))}
    assert [b.close for b in got[()]["cl.csv"]] == [18.27]
    assert [b.close for b in got[("--signed-prices",)]["cl.csv"]] == [18.27, -37.63, 10.01]
