"""`streamllm calibrate` on the tiny model: report keys, sample counts, the plot, clear errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from feeds.sources import TableSource
from streamllm.cli.calibrate import main as cli_main
from streamllm.cli.calibrate import parser as _parser
from streamllm.config import load_config
from streamllm.engine.prompt import PromptLayout
from streamllm.evaluation.calibrate import CalibrationError, _without_head, calibrate
from streamllm.evaluation.report import (
    CONFIDENCES,
    QuestionRecord,
    confidence_for_target,
    gate_at,
    live_gate,
    record_blocks,
    summarize,
    table,
)
from streamllm.feeding.render import Renderer

SHARED_BARS = Path(__file__).resolve().parents[2] / "shared" / "data" / "bars" / "btc-perp-20211231-20220201_1m.csv"

CONFIG = """
[[sessions]]
name = "{name}"
instrument = "TEST"
max_context_tokens = {max_context}

[[sessions.questions]]
id = "trend"
text = "Is the price going up or down over the last 5 bars?"
choices = ["up", "down"]
label = "trend_up(n=5)"

[[sessions.questions]]
id = "sma"
text = "Is the last close above the average close of the last 10 bars?"
choices = ["yes", "no"]
label = "above_sma(n=10)"

[[sessions.questions]]
id = "free"
text = "What is the last close?"
"""


def write_bars(path: Path, rows: int = 60) -> Path:
    lines = ["timestamp,open,high,low,close,volume"]
    close = 100.0
    for i in range(rows):
        # A deterministic zig-zag with drift, so both answers of each label occur.
        step = (3.0 if (i // 4) % 2 == 0 else -2.0) + (i % 3 - 1) * 0.5
        open_, close = close, close + step
        lines.append(f"2024-01-02 10:{i:02d}:00,{open_:.1f},{max(open_, close) + 0.5:.1f},"
                     f"{min(open_, close) - 0.5:.1f},{close:.1f},{1000 + 37 * (i % 7)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Path]:
    config = tmp_path / "calib.toml"
    config.write_text(CONFIG.format(name="test", max_context=4096))
    return {"config": config, "data": write_bars(tmp_path / "bars.csv"), "dir": tmp_path}


def args_for(setup: dict[str, Path], *extra: str) -> list[str]:
    return ["--questions", str(setup["config"]), "--data", str(setup["data"]), "--model", "tiny",
            "--no-progress", *extra]


def test_calibration_report_and_plot(setup, tiny_model, capsys):
    out_json, out_png = setup["dir"] / "out.json", setup["dir"] / "out.png"
    args = _parser().parse_args(args_for(setup, "--warmup", "0", "--target-precision", "0.8"))
    run, reports, _ = calibrate(args, model=tiny_model)
    assert run.updates == 60
    assert [r.id for r in reports] == ["trend", "sma"]  # the unlabelled question is not calibrated

    # One sample per update whose label is known: trend_up(n=5) from bar 5, above_sma(n=10) from bar 10.
    bars = TableSource(setup["data"], "bar").events()
    spec = load_config(setup["config"]).session("test")
    for report, question in zip(reports, spec.questions[:2], strict=True):
        known = sum(question.expected_answer(bars[: i + 1]) is not None for i in range(60))
        assert report.samples == known
        assert report.unknown == 60 - known
    assert [r.samples for r in reports] == [56, 51]

    record = run.records[0]
    assert gate_at(record.gaps, record.correct, 0.0)[0] == 1.0
    assert reports[0].curve[0].coverage == 1.0

    # The same run from the command line writes the JSON and the PNG.
    assert cli_main(args_for(setup, "--warmup", "0", "--target-precision", "0.8",
                             "--json", str(out_json), "--plot", str(out_png))) == 0
    printed = capsys.readouterr().out
    assert "question" in printed and "trend" in printed and "sma" in printed
    report = json.loads(out_json.read_text())
    for q in ("trend", "sma"):
        for key in ("threshold", "coverage", "precision", "samples", "base_rate", "majority_precision",
                    "accuracy", "config_threshold", "config_coverage"):
            assert f"{q}.{key}" in report
        curve = report["curves"][q]
        assert len(curve["threshold"]) == len(curve["coverage"]) == len(curve["precision"]) > 0
        assert curve["coverage"][0] == 1.0
        assert curve["threshold"] == sorted(curve["threshold"])
        if report[f"{q}.threshold"] is None:  # unreachable: said plainly, nothing made up
            assert report[f"{q}.coverage"] == 0.0 and report[f"{q}.precision"] is None
            assert f"{q}: the gate never reaches precision 0.8" in printed
        else:
            assert report[f"{q}.precision"] >= 0.8
    assert report["trend.samples"] == 56 and report["sma.samples"] == 51
    for record, r in zip(run.records, reports, strict=True):  # the live gate, as the engine would run it here
        live = live_gate(record, 0.8)
        assert report[f"live_fired.{r.id}"] == live.fired and report[f"live_first.{r.id}"] == live.first
        assert report[f"live_coverage.{r.id}"] == round(live.coverage, 6)
        assert report[f"live_confidence.{r.id}"] == 0.5
        by = {g["confidence"]: g for g in report[f"live_by_confidence.{r.id}"]}
        assert list(by) == list(CONFIDENCES) and by[0.5]["fired"] == live.fired
        assert report[f"live_confidence_for_target.{r.id}"] == next(
            (c for c, g in by.items() if g["precision"] is not None and g["precision"] >= 0.8), None)
    assert report["live_min_coverage"] == min(report["live_coverage.trend"], report["live_coverage.sma"])
    # Every sample as a row, for a look of one's own.
    import polars as pl

    for name in ("samples.csv", "samples.parquet"):
        assert cli_main(args_for(setup, "--warmup", "0", "--target-precision", "0.8",
                                 "--samples", str(setup["dir"] / name))) == 0
        rows = pl.read_csv(setup["dir"] / name) if name.endswith(".csv") else pl.read_parquet(setup["dir"] / name)
        assert rows.height == 56 + 51 and rows.columns == ["question", "range", "bar", "gap", "answer", "truth",
                                                           "correct", "live_fired"]
        trend = rows.filter(pl.col("question") == "trend")
        assert trend["gap"].to_list() == pytest.approx(run.records[0].gaps, abs=1e-5)
        assert trend["truth"].to_list() == run.records[0].truths and trend["bar"].to_list() == run.records[0].bars
        assert trend["live_fired"].sum() == report["live_fired.trend"]
    assert report["updates"] == 60 and report["bars"] == 60
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_warmup_records_only_known_labels(setup, tiny_model):
    args = _parser().parse_args(args_for(setup, "--bars", "30"))
    run, reports, _ = calibrate(args, model=tiny_model)
    # Longest history is above_sma(n=10): 9 warmup bars in one batch, then every label is known.
    assert run.warmup == 9 and run.updates == 21 and run.bars == 30
    assert [r.samples for r in reports] == [21, 21] and all(r.unknown == 0 for r in reports)


def test_summary_unreachable_target_and_base_rate():
    from streamllm.config import parse_question

    spec = parse_question({"id": "q", "text": "up?", "choices": ["up", "down"], "label": "trend_up(n=2)",
                           "threshold": 1.5})
    record = QuestionRecord(spec, gaps=[0.5, 1.0, 2.0, 3.0], answers=["up", "down", "up", "down"],
                            truths=["up", "up", "down", "up"])
    report = summarize(record, target=0.9)
    assert report.threshold is None and report.coverage == 0.0 and report.precision is None
    assert report.majority == "up" and report.base_rate == report.majority_precision == 0.75
    assert report.accuracy == 0.25 and report.config_coverage == 0.5 and report.config_precision == 0.0
    reachable = summarize(record, target=0.25)
    assert reachable.threshold == 0.5 and reachable.coverage == 1.0 and reachable.fired == 4
    assert math.isclose(summarize(record, target=0.2).precision, 0.25)
    text = table([report], 0.9)
    assert "q: the gate never reaches precision 0.9 (best 0.25)" in text
    assert "q: its configured threshold 1.5" not in text  # it fires on 2 of 4

    # A model that always gives the majority answer reaches the target, and the table says what that is worth.
    lazy = QuestionRecord(spec, gaps=[1.0] * 10, answers=["down"] * 10, truths=["down"] * 9 + ["up"])
    lazy_report = summarize(lazy, target=0.9)
    assert lazy_report.precision == 0.9 and lazy_report.top_answer_share == 1.0
    text = table([lazy_report], 0.9)
    assert "no better than always answering 'down' (0.90)" in text
    assert "configured threshold 1.5 never fires" in text
    # Balanced accuracy sees through it: all 'down' right, the one 'up' wrong -> (1 + 0) / 2.
    assert lazy_report.accuracy == 0.9 and lazy_report.balanced_accuracy == 0.5
    assert report.balanced_accuracy == (1 / 3 + 0) / 2  # 'up' right 1 of 3, 'down' 0 of 1
    # Ranks: 'up' truths lean 0.5, -1.0, -3.0 toward up, the 'down' truth 2.0: every pair misordered.
    assert report.ranking == 0.0 and lazy_report.ranking == 0.5  # a constant margin orders nothing
    assert "margin barely tells the truths apart (ranks 0.50)" in text
    # Under 30 scored answers no bias is fitted: the biased replay is the argmax itself.
    assert lazy_report.biased.accuracy == lazy_report.accuracy and lazy_report.biased.said_first == 0
    assert "accuracy 0.90 (argmax 0.90); answered 'up' 0 times, right 0" in text


def _live_record(n: int, seed: int = 3) -> QuestionRecord:
    """A head that is right when its gap is large (gap > 1: right 95%; else a coin), truth runs of 4-12."""
    import random

    from streamllm.config import parse_question

    spec = parse_question({"id": "q", "text": "up?", "choices": ["up", "down"], "label": "trend_up(n=2)"})
    rng = random.Random(seed)
    record, truth, left = QuestionRecord(spec), "up", 0
    for i in range(n):
        if left == 0:
            truth, left = ("down" if truth == "up" else "up"), rng.randint(4, 12)
        left -= 1
        gap = rng.uniform(0, 3)
        right = rng.random() < (0.95 if gap > 1 else 0.5)
        record.gaps.append(gap)
        record.truths.append(truth)
        record.answers.append(truth if right else ("down" if truth == "up" else "up"))
        record.bars.append(i)
    return record


def test_live_gate_is_the_engines_auto_threshold_on_the_replay():
    """What threshold = "auto:0.9" would do: closed until an answer has 30 fired samples over 5 truth runs,
    then firing only where the answers before were right; hindsight's threshold sees every answer."""
    record = _live_record(600)
    live = live_gate(record, 0.9)
    assert live.first is not None and live.first >= 30  # nothing fires on no evidence
    assert 0.2 < live.coverage < 0.8 and live.precision >= 0.85  # it fires where gaps are large, and is right there
    # No evidence, no fast answers: a head that is never better than a coin never opens.
    coin = _live_record(600)
    coin.answers = [a if k % 2 else ("down" if a == "up" else "up") for k, a in enumerate(coin.truths)]
    assert live_gate(coin, 0.9).first is None and live_gate(coin, 0.9).fired == 0
    # Pooled ranges share one window (one session serving the market for longer): the second range
    # starts open, so it fires more than the first did from closed.
    twice = QuestionRecord(record.spec, record.gaps * 2, record.answers * 2, record.truths * 2,
                           record.bars * 2, [0] * 600 + [1] * 600)
    pooled = live_gate(twice, 0.9)
    assert pooled.first == live.first and pooled.fired > 2 * live.fired
    report = summarize(record, 0.9)
    assert report.live == live and live.confidence == 0.5  # the question's own auto_confidence (default)
    text = table([report], 0.9)
    assert f"fired on {live.coverage:.2f} ({live.fired}) at precision {live.precision:.2f}" in text


def test_a_confident_live_gate_fires_on_a_subset_and_follows_the_question_or_the_flag():
    """auto_confidence judges each threshold by a lower bound of its precision: on the same window
    no threshold it accepts is one the point estimate rejects, so it fires on fewer answers, later."""
    record = _live_record(1200, seed=5)
    point, sure = live_gate(record, 0.9), live_gate(record, 0.9, confidence=0.9)
    assert sure.fired < point.fired and sure.first >= point.first
    # (not answer by answer: the recent check may hold the point gate closed where the stricter one,
    # firing on surer answers only, still reaches the target)
    assert sure.confidence == 0.9 and summarize(record, 0.9, 0.9).live == sure
    own = QuestionRecord(dataclasses.replace(record.spec, auto_confidence=0.9), record.gaps, record.answers,
                         record.truths, record.bars)
    assert live_gate(own, 0.9) == sure and live_gate(own, 0.9, 0.5) == point
    assert "(auto_confidence 0.9)" in table([summarize(record, 0.9, 0.9)], 0.9)
    # Every report also replays the gate at each of CONFIDENCES, for choosing one.
    report = summarize(record, 0.9)
    assert [g.confidence for g in report.live_by_confidence] == list(CONFIDENCES)
    assert report.live_by_confidence[CONFIDENCES.index(0.5)] == point
    assert report.live_by_confidence[CONFIDENCES.index(0.9)] == sure
    fired = [g.fired for g in report.live_by_confidence]
    # The strictest fires least; not monotone in between: a looser gate fires on weaker answers, whose
    # misses can hold it closed (the recent check) where a stricter one stays open.
    assert fired[-1] == min(fired) and fired[0] > fired[-1]
    row = next(line for line in table([report], 0.9).splitlines() if line.strip().startswith("q ")
               and "@" in line)
    assert f"{sure.coverage:.2f} @ {sure.precision:.3f}" in row
    reaching = [g.confidence for g in report.live_by_confidence if g.precision >= 0.9]
    assert row.endswith(f"   {reaching[0]:g}" if reaching else "   none")
    assert confidence_for_target(report, 0.9) == (reaching[0] if reaching else None)
    assert confidence_for_target(report, 0.999) is None


def _error(capsys, argv: list[str]) -> str:
    assert cli_main(argv) == 2
    return capsys.readouterr().err


RUN_KEYS = {"data", "start", "adapter", "adapter_id", "model", "bars", "warmup", "updates", "context_tokens",
            "seconds", "from_samples", "without_head", "left_out_no_volume"}  # what a replay knows of itself and a file of its samples does not


@pytest.mark.parametrize("name", ["samples.parquet", "samples.csv"])
def test_recorded_samples_judged_again_give_the_replays_report(setup, tiny_model, capsys, name):
    """--from-samples: the rows a pooled replay wrote, judged with no model, give every figure of that
    replay's report (thresholds, curves, intervals by range, the live gate); then another confidence."""
    replayed, again, rows = setup["dir"] / "replayed.json", setup["dir"] / "again.json", setup["dir"] / name
    pooled = ("--start", "0", "30", "--bars", "25", "--target-precision", "0.6")
    assert cli_main(args_for(setup, *pooled, "--json", str(replayed), "--samples", str(rows))) == 0
    capsys.readouterr()
    judge = ["--questions", str(setup["config"]), "--from-samples", str(rows), "--target-precision", "0.6"]
    assert cli_main([*judge, "--json", str(again)]) == 0
    assert "samples on 32 bars in 2 ranges pooled from" in capsys.readouterr().out
    first, second = json.loads(replayed.read_text()), json.loads(again.read_text())
    assert set(first) - RUN_KEYS == set(second) - RUN_KEYS
    assert {k: v for k, v in first.items() if k not in RUN_KEYS} == {k: v for k, v in second.items() if k not in RUN_KEYS}
    assert second["start"] == [0, 1] and second["from_samples"] == str(rows)
    # ... and judged at another auto_confidence: only the live figures can change, and fire no more.
    assert cli_main([*judge, "--auto-confidence", "0.95", "--json", str(again)]) == 0
    sure = json.loads(again.read_text())
    for q in ("trend", "sma"):
        assert sure[f"live_confidence.{q}"] == 0.95 and sure[f"live_fired.{q}"] <= first[f"live_fired.{q}"]
        assert sure[f"coverage_at_target.{q}"] == first[f"coverage_at_target.{q}"]


def test_a_samples_file_that_cannot_be_judged_says_what_and_where(setup, capsys):
    import polars as pl

    def judge(path, *extra):
        return _error(capsys, ["--questions", str(setup["config"]), "--from-samples", str(path), *extra])

    good = {"question": ["trend", "trend", "sma"], "range": [0, 0, 0], "bar": [5, 6, 10], "gap": [0.5, 1.5, 2.0],
            "answer": ["up", "down", "yes"], "truth": ["up", "up", "no"]}
    path = setup["dir"] / "s.csv"
    assert "does not exist" in judge(path)
    pl.DataFrame({k: v for k, v in good.items() if k != "truth"}).write_csv(path)
    assert "no column truth" in judge(path)
    pl.DataFrame({**good, "gap": [0.5, None, 2.0]}).write_csv(path)
    assert "data row 2: gap is empty or not a finite value" in judge(path)
    pl.DataFrame({**good, "question": ["trend", "volume", "sma"]}).write_csv(path)
    err = judge(path)
    assert "question 'volume' is not a labelled question of session 'test' (trend, sma)" in err
    pl.DataFrame({**good, "answer": ["up", "sideways", "yes"]}).write_csv(path)
    assert "question 'trend': answer 'sideways' is not one of its choices ['up', 'down']" in judge(path)
    path.write_bytes(b"\x00\x01 not a table")
    assert "no column question, range, bar, gap, answer, truth" in judge(path)
    bad = setup["dir"] / "s.parquet"
    bad.write_bytes(b"PAR1 broken")
    assert "not a readable samples table" in judge(bad)
    pl.DataFrame(good).write_csv(path)
    assert "--data, --start only apply to a replay" in judge(path, "--data", str(setup["data"]), "--start", "5")


def test_several_ranges_pool_into_one_report(setup, tiny_model, capsys):
    """--start A B: each range replayed in a fresh session, the samples end to end, one threshold for all,
    and no interval block spanning two ranges."""
    single = [calibrate(_parser().parse_args(args_for(setup, "--start", s, "--bars", "25")), model=tiny_model)[0]
              for s in ("0", "30")]
    run, reports, meta = calibrate(_parser().parse_args(args_for(setup, "--start", "0", "30", "--bars", "25")),
                                   model=tiny_model)
    assert meta["start"] == [0, 30] and run.updates == single[0].updates + single[1].updates == 2 * 16
    for k, rec in enumerate(run.records):
        first, second = single[0].records[k], single[1].records[k]
        assert rec.truths == first.truths + second.truths and rec.answers == first.answers + second.answers
        assert rec.gaps == pytest.approx(first.gaps + second.gaps)
        assert rec.bars == first.bars + second.bars and rec.ranges == [0] * len(first.bars) + [1] * len(second.bars)
        blocks = record_blocks(rec, 21)  # a block as long as the range: still never one across two ranges
        assert not set(blocks[:len(first.bars)]) & set(blocks[len(first.bars):])
        assert reports[k].samples == len(first.gaps) + len(second.gaps)
    assert cli_main(args_for(setup, "--start", "0", "30", "--bars", "25")) == 0
    assert "in 2 ranges pooled" in capsys.readouterr().out
    err = _error(capsys, args_for(setup, "--start", "0", "99"))
    assert "--start 99 is outside the file's 60 bars" in err


def test_every_range_is_fitted_before_any_replay(setup, tiny_model, capsys):
    """--start A B: a range whose bars cannot fit the context is refused before the first range runs."""
    rows = setup["data"].read_text().splitlines()
    longer = [rows[0], *rows[1:31]]
    for i, r in enumerate(rows[31:]):  # the second range's prices and moves have many more digits
        t, *ohlc, v = r.split(",")
        longer.append(",".join([t, *(f"{float(x) * 1000 + 0.000371 * i * (k + 1):.6f}" for k, x in enumerate(ohlc)), v]))
    data = setup["dir"] / "longer.csv"
    data.write_text("\n".join(longer) + "\n")
    spec = load_config(setup["config"]).session("test")
    layout = PromptLayout(tiny_model.tokenizer)
    bars = TableSource(data, "bar").events()
    need = [len(layout.prefix_ids(spec.system_prompt)) + sum(len(ids) for ids in layout.lines_ids(
        [Renderer(changes=spec.render.changes).render(b) for b in bars[start:start + 30]])) for start in (0, 30)]
    assert need[1] > need[0] + 300
    tight = setup["dir"] / "tight.toml"
    tight.write_text(CONFIG.format(name="test", max_context=(need[0] + need[1]) // 2))
    args = _parser().parse_args(args_for({**setup, "config": tight, "data": data}, "--start", "0", "30", "--bars", "30"))
    with pytest.raises(CalibrationError, match="range --start 30: --bars 30 needs"):
        calibrate(args, model=tiny_model)
    assert "range 1 of 2" not in capsys.readouterr().out  # nothing replayed before the refusal


def test_calibrate_names_what_it_leaves_out_and_what_its_minimum_counts(setup, tiny_model, capsys):
    out = setup["dir"] / "r.json"
    assert cli_main(args_for(setup, "--bars", "20", "--json", str(out))) == 0
    captured = capsys.readouterr()
    assert "left out, having no label to judge them by: free" in captured.err
    report = json.loads(out.read_text())
    assert report["left_out_no_label"] == ["free"] and report["without_head"] == ["trend", "sma"]
    assert "over 2 questions; every question decided by the model's own logits" in captured.out

    class OneHead:  # an adapter whose only choice head answers `trend`
        def head_for(self, text: str, choices: tuple[str, ...]) -> object | None:
            return object() if choices == ("up", "down") else None

    spec = load_config(setup["config"]).session("test")
    assert _without_head(spec, OneHead()) == ["sma"] and _without_head(spec, None) == ["trend", "sma"]


def test_bars_without_volume_leave_volume_questions_out_by_name(setup, tiny_model, capsys):
    rows = setup["data"].read_text().splitlines()
    fx = setup["dir"] / "fx.csv"
    fx.write_text("\n".join(r.rpartition(",")[0] for r in rows) + "\n")  # no volume column, as FX brokers export
    config = setup["dir"] / "vol.toml"
    config.write_text(CONFIG.format(name="test", max_context=4096) + '\n[[sessions.questions]]\nid = "spike"\n'
                      'text = "Is the last bar\'s volume a spike?"\nchoices = ["yes", "no"]\nlabel = "volume_spike(n=5)"\n')
    out = setup["dir"] / "r.json"
    assert cli_main(args_for({**setup, "config": config, "data": fx}, "--bars", "20", "--json", str(out))) == 0
    captured = capsys.readouterr()
    assert "fx.csv has no volume: spike cannot be answered" in captured.err
    assert "left out, their labels reading volume the bars do not have: spike" in captured.out
    report = json.loads(out.read_text())
    assert report["left_out_no_volume"] == ["spike"] and "trend.samples" in report and "spike.samples" not in report
    only = setup["dir"] / "only.toml"
    only.write_text('[[sessions]]\nname = "v"\ninstrument = "TEST"\n[[sessions.questions]]\nid = "spike"\n'
                    'text = "Spike?"\nchoices = ["yes", "no"]\nlabel = "volume_spike(n=5)"\n')
    err = _error(capsys, args_for({**setup, "config": only, "data": fx}))
    assert "every labelled question of session 'v' reads volume (spike)" in err


def test_reads_volume_names_every_label_whose_answer_depends_on_volume():
    from streamllm.config.labels import LABELS, parse_label

    rng = np.random.default_rng(7)
    closes = 100 + np.cumsum(rng.normal(0, 1, 80))
    depends = set()
    for name in LABELS:
        label = parse_label(name)
        for end in range(label.bars_needed, 80):
            window = [{"open": closes[i - 1] if i else closes[0], "high": closes[i] + 1, "low": closes[i] - 1,
                       "close": closes[i], "volume": v} for i, v in zip(range(end), rng.choice([0.01, 1000.0], end), strict=True)]
            flat = [{**b, "volume": 5.0} for b in window]
            if label.evaluate(window) != label.evaluate(flat):
                depends.add(name)
                break
    reads_volume = {name for name in LABELS if parse_label(name).reads_volume}
    assert depends == reads_volume == {"above_vwap", "volume_spike"}
    unknown = [{"open": 1.0, "high": 2.0, "low": 0.5, "close": 1.5, "volume": math.nan}] * 21
    assert [parse_label(n).evaluate(unknown) for n in sorted(reads_volume)] == [None, None]  # no truth, no guess


def test_clear_errors(setup, capsys):
    unlabelled = setup["dir"] / "plain.toml"
    unlabelled.write_text('[[sessions]]\nname = "plain"\ninstrument = "X"\n'
                          '[[sessions.questions]]\nid = "q"\ntext = "What is the last close?"\n')
    err = _error(capsys, args_for({**setup, "config": unlabelled}))
    assert "no labelled questions" in err and "plain" in err

    err = _error(capsys, args_for({**setup, "data": setup["dir"] / "missing.csv"}))
    assert "missing.csv" in err and "does not exist" in err

    err = _error(capsys, args_for(setup, "--session", "nope"))
    assert "no session 'nope'" in err and "test" in err

    small = setup["dir"] / "small.toml"
    small.write_text(CONFIG.format(name="small", max_context=256))
    err = _error(capsys, args_for({**setup, "config": small}, "--bars", "60"))
    assert "max_context_tokens 256" in err and "lower --bars" in err

    err = _error(capsys, args_for(setup, "--warmup", "60"))
    assert "--warmup 60" in err

    err = _error(capsys, args_for(setup, "--auto-confidence", "1"))
    assert "--auto-confidence must be in [0.5, 1), got 1.0" in err


def test_files_are_read_as_every_command_reads_them(setup, tiny_model, capsys):
    """calibrate reads files as tune does (tuning/data.load_bars): of a table with several instruments the
    session's bars, never the two interleaved; trades as bars of the session's interval; an instrument
    the file lacks is refused by name."""
    rows = setup["data"].read_text().splitlines()
    two = setup["dir"] / "two.csv"
    two.write_text(f"symbol,{rows[0]}\n" + "".join(f"{s},{r}\n" for r in rows[1:] for s in ("OTHER", "TEST")))
    run, _, _ = calibrate(_parser().parse_args(args_for({**setup, "data": two}, "--warmup", "0")), model=tiny_model)
    assert run.updates == 60
    assert "session test: two.csv:TEST: 60 bars of 60 s, 2024-01-02 to 2024-01-02" in capsys.readouterr().err
    trades = setup["dir"] / "trades.csv"
    trades.write_text("timestamp,price,size\n" + "".join(
        f"2024-01-02 10:{i // 6:02d}:{i % 6 * 10:02d},{100 + (i % 5) * 0.5 + (i // 6)},{1 + i % 3}\n"
        for i in range(6 * 30)))
    minutes = setup["dir"] / "minutes.toml"
    minutes.write_text(setup["config"].read_text() + '[sessions.render]\nmode = "bars"\nbar_seconds = 60\n')
    run, reports, _ = calibrate(_parser().parse_args(args_for({**setup, "config": minutes, "data": trades},
                                                              "--warmup", "0")), model=tiny_model)
    assert run.updates == 30 and reports[0].samples == 30 - 4  # trend_up(n=5) from the 5th one-minute bar
    # PATH@FROM..TO: the bars opening in that range, as tune takes it (write_bars: 10:00 to 10:59)
    run, _, meta = calibrate(_parser().parse_args(args_for({**setup, "data": f"{setup['data']}@2024-01-02T10:20.."},
                                                           "--warmup", "0")), model=tiny_model)
    assert run.updates == 40 and meta["data"].endswith("bars.csv@2024-01-02T10:20..")
    err = _error(capsys, args_for({**setup, "data": f"{setup['data']}@2024-13-01.."}))
    assert "'2024-13-01' is not an ISO date" in err
    other = setup["dir"] / "other.toml"
    other.write_text(CONFIG.format(name="test", max_context=4096).replace('instrument = "TEST"', 'instrument = "NOPE"'))
    err = _error(capsys, args_for({**setup, "config": other, "data": two}))
    assert "two.csv holds two.csv:OTHER, two.csv:TEST" in err and "'NOPE' is not one of them" in err


@pytest.mark.integration
@pytest.mark.skipif(not SHARED_BARS.is_file(), reason="../shared/data is absent")
def test_real_model_on_30_bars(tmp_path):
    out = tmp_path / "calib.json"
    root = Path(__file__).resolve().parents[1]
    assert cli_main(["--questions", str(root / "queries" / "bars.toml"), "--data", str(SHARED_BARS),
                     "--bars", "30", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert Path(report["adapter"]) == root / "queries" / "adapters" / "bars"  # the config's heads, as serve loads them
    assert cli_main(["--questions", str(root / "queries" / "bars.toml"), "--data", str(SHARED_BARS),
                     "--bars", "22", "--no-progress", "--no-adapter", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["adapter"] is None  # the untuned model, on request
    with pytest.raises(SystemExit):
        cli_main(["--questions", "q.toml", "--data", "x.csv", "--adapter", "d", "--no-adapter"])
    # volatility_rising(n=10) needs 21 bars: a 20-bar warmup, then 10 samples for every question.
    assert report["updates"] == 10
    for q in ("trend_10m", "above_sma", "volatility", "volume_spike"):
        assert report[f"{q}.samples"] == 10
        assert report["curves"][q]["coverage"][0] == 1.0
