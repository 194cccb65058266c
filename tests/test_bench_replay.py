"""bench replay: the load generator, the baselines' stopping rule and cache, the live per-system
replay end to end (tiny model), and a report that survives a crash mid-way."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bench.replay
from bench.baselines import Peer, PrefixCache, Stateless, common_prefix
from bench.live import LiveAsk, SystemRun, TokenSink, diverged, live_schedule
from bench.loadgen import poisson_schedule
from bench.replay import cli_main, matches
from bench.replay_metrics import base_rate
from streamllm.config import QuestionSpec, load_config
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.standing.gate import Gate
from tests.fake_peer import serve

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "binance-spot"
ROOT = Path(__file__).resolve().parents[1]
PER_SPEED = ("{s}_ms_p50@{v}", "{s}_ms_p99@{v}", "{s}_accuracy@{v}", "{s}_base_rate@{v}", "{s}_asks@{v}",
             "{s}_diverged@{v}")
OURS = ("speedup_vs_prefixcache@{v}", "speedup_vs_stateless@{v}", "gate_coverage@{v}", "gate_precision@{v}",
        "lag_versions_p99@{v}", "compactions@{v}")
STANDING = {"btc": ["trend_1m", "volume_spike"], "eth": ["trend_1m"]}


def test_poisson_schedule_is_seeded():
    a = poisson_schedule(3, rate=5.0, duration_s=20.0, standing=STANDING)
    assert a == poisson_schedule(3, rate=5.0, duration_s=20.0, standing=STANDING)
    assert a != poisson_schedule(4, rate=5.0, duration_s=20.0, standing=STANDING)
    times = [ev.at_s for ev in a]
    assert times == sorted(times) and all(0 < t < 20.0 for t in times)
    assert 50 <= len(a) <= 150  # ~100 expected at 5/s over 20 s
    assert {ev.standing for ev in a} == {True, False}
    assert all(ev.question in STANDING[ev.session] for ev in a if ev.standing)


def test_matches_first_word():
    assert matches("Up.", "up") and matches(" yes, clearly", "yes")
    assert not matches("", "up") and not matches("upward", "up")
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


@pytest.fixture
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=8192, max_context=2048, branch_cells=1024))
    yield eng
    eng.shutdown()


def test_prefix_cache_is_a_real_cache(engine):
    """Its logits equal a one-shot prefill's, and it computes only the data added since the last question."""
    layout = engine.layout
    prefix = layout.prefix_ids("You watch bars.")
    bars = layout.lines_ids([f"00:0{i} 6140{i} +{i} v1.2K n{i}" for i in range(8)])
    first = prefix + [t for ids in bars[:5] for t in ids]
    second = first + [t for ids in bars[5:] for t in ids]
    question = layout.question_ids("Is the price going up or down?")
    cache, stateless = PrefixCache(engine, chunk=16), Stateless(engine, chunk=1024)
    try:
        cache.answer("s", first, question, max_tokens=2)
        ans = cache.answer("s", second, question, max_tokens=1)
        one_shot = stateless.answer(second, question, max_tokens=1)
        assert ans.tokens_computed == len(second) - len(first) + len(question)
        assert one_shot.tokens_computed == len(second) + len(question)
        assert torch.allclose(ans.first_logits, one_shot.first_logits, atol=1e-4)
        assert ans.tokens == one_shot.tokens
        # A context that diverges is cut back to the common prefix, then extended.
        other = first[:-3] + [t for ids in bars[6:] for t in ids]
        ans = cache.answer("s", other, question, max_tokens=1)
        assert ans.tokens_computed == len(other) - (len(first) - 3) + len(question)
        assert torch.allclose(ans.first_logits, stateless.answer(other, question, 1).first_logits, atol=1e-4)
    finally:
        cache.close()
    engine.check_integrity()
    assert engine.store.manager.num_used_blocks == 0


def test_peer_gets_the_same_prompt_with_cache_prompt(tiny_model):
    seen: list[dict] = []
    server = serve({"choices": [{"text": " up"}], "usage": {"completion_tokens": 1}, "timings": {"prompt_n": 7}}, seen)
    try:
        tok = tiny_model.tokenizer
        ids = tok("hello there", add_special_tokens=False)["input_ids"]
        ans = Peer(f"http://127.0.0.1:{server.server_port}", tok).answer(ids, ids, 3)
    finally:
        server.shutdown()
    assert ans.text == "up" and ans.tokens_computed == 8
    assert seen[0]["path"] == "/v1/completions" and seen[0]["cache_prompt"] is True
    assert seen[0]["prompt"] == tok.decode(ids + ids) and seen[0]["max_tokens"] == 3


QUESTION = QuestionSpec("trend", "Is the price going up or down?", ("up", "down"), 0.5, 4)


def test_peer_answers_a_choice_question_by_its_first_token_alternatives(tiny_model):
    tok = tiny_model.tokenizer
    gate = Gate.for_question(QUESTION, tok)
    down = gate.candidates("down")[0]
    up = gate.candidates("up")[0]
    top = [{"id": 17, "token": "x", "logprob": -0.1}, {"id": down, "token": tok.decode([down]), "logprob": -1.0},
           {"id": up, "token": tok.decode([up]), "logprob": -2.0}]
    seen: list[dict] = []
    server = serve({"choices": [{"text": "x", "logprobs": {"content": [{"id": 17, "token": "x", "logprob": -0.1,
                                                                         "top_logprobs": top}]}}]}, seen)
    try:
        ids = tok("hello there", add_special_tokens=False)["input_ids"]
        ans = Peer(f"http://127.0.0.1:{server.server_port}", tok).answer(ids, ids, 4, gate)
    finally:
        server.shutdown()
    # The best choice wins even though the model's top token is neither: the engine's rule.
    assert ans.text == "down" and ans.choices["down"] == pytest.approx(1 / (1 + math.exp(-1.0)))
    assert seen[0]["max_tokens"] == 1 and seen[0]["n_probs"] >= 2 and seen[0]["logprobs"] >= 2


def test_baselines_stop_where_the_engine_does_on_the_same_token_ids(engine):
    """Same context and question ids as the engine's session, same gate: same choice, same probabilities."""
    engine.open_session("s", system="You watch bars.")
    engine.register("s", QUESTION)
    lines = [f"00:0{i} 6140{i} +{i} v1.2K n{i}" for i in range(6)]
    engine.push("s", lines[:3])
    engine.push("s", lines[3:])
    engine.wait_idle()
    ours = engine.ask("s", "trend")
    session = engine.sessions["s"]
    context = engine.call(lambda _c: list(session.token_ids[: session.version_length(ours.data_version)]))
    config = SimpleNamespace(sessions=[SimpleNamespace(name="s", system_prompt="You watch bars.")])
    sink = TokenSink(engine.layout, config)
    sink.push("s", lines[:3])
    sink.push("s", lines[3:])
    assert sink.snapshot("s") == (2, context)  # the baselines see exactly our prompt token ids
    gate = Gate.for_question(QUESTION, engine.tokenizer)
    qids = engine.layout.question_ids(QUESTION.text)
    cache, stateless = PrefixCache(engine), Stateless(engine)
    try:
        for ans in (cache.answer("s", context, qids, QUESTION.max_tokens, gate),
                    stateless.answer(context, qids, QUESTION.max_tokens, gate)):
            assert ans.text == ours.text in QUESTION.choices
            assert ans.tokens_computed <= len(context) + len(qids)  # no decoding past the first token
            for choice, p in ours.choices.items():
                assert ans.choices[choice] == pytest.approx(p, abs=1e-4)
    finally:
        cache.close()
    engine.check_integrity()


def test_live_schedule_is_seeded_and_mixes_standing_and_adhoc():
    config = load_config(ROOT / "queries" / "crypto.toml")
    a = live_schedule(5, 4.0, 1.0, 30.0, config)
    assert a == live_schedule(5, 4.0, 1.0, 30.0, config) and a != live_schedule(6, 4.0, 1.0, 30.0, config)
    standing = [ev for ev in a if ev.standing]
    assert 80 <= len(standing) <= 160 and 10 <= len(a) - len(standing) <= 55
    assert [ev.at_s for ev in a] == sorted(ev.at_s for ev in a)


def _asks(ms: list[float], lags: list[int] | None = None, missing: int = 0) -> SystemRun:
    run = SystemRun("x", 1.0)
    for i, x in enumerate(ms):
        run.asks.append(LiveAsk("x", i, "s", "q", None, 0, t0=float(i), ms=x, lag=(lags or [0] * len(ms))[i]))
    run.asks += [LiveAsk("x", 99, "s", "q", None, 0, error="not answered") for _ in range(missing)]
    return run


def test_divergence_rule():
    assert not diverged(_asks([100.0] * 9))[0]
    assert diverged(_asks([100.0] * 3 + [200.0] * 3 + [900.0] * 3))[0]  # queue grows: 9x and over 250 ms
    assert not diverged(_asks([1.0] * 3 + [5.0] * 3 + [9.0] * 3))[0]  # 9x but a few ms: noise, not a queue
    assert diverged(_asks([100.0] * 9, missing=1))[0]
    assert diverged(_asks([0.1] * 9, lags=[0, 0, 0, 2, 3, 3, 4, 5, 6]))[0]


def _run(tmp_path: Path, extra: list[str]) -> dict:
    out = tmp_path / "report"
    rc = cli_main(["--model", "tiny", "--quick", "--speeds", "1,20", "--duration", "6", "--asks", "8",
                   "--systems", "ours,prefixcache,stateless", "--stateless-every", "3",
                   "--json", str(tmp_path / "report.json"), "--out", str(out), *extra])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    for v in ("1", "20"):
        for s in ("ours", "prefixcache", "stateless"):
            for key in PER_SPEED:
                assert key.format(s=s, v=v) in report, key.format(s=s, v=v)
        for key in OURS:
            assert key.format(v=v) in report, key.format(v=v)
        assert report[f"ours_asks@{v}"] >= 1 and report[f"ours_unanswered@{v}"] == 0
        # Per question: its labelled asks add up to the whole, and so do its right answers.
        per_q = {k.split(".", 1)[1].split("@")[0] for k in report if k.startswith("ours_labelled.") and k.endswith(f"@{v}")}
        n = report[f"ours_labelled@{v}"]
        if n:
            assert per_q and sum(report[f"ours_labelled.{q}@{v}"] for q in per_q) == n
            assert sum(report[f"ours_accuracy.{q}@{v}"] * report[f"ours_labelled.{q}@{v}"]
                       for q in per_q) == pytest.approx(report[f"ours_accuracy@{v}"] * n, abs=1e-3 * n)  # accuracies rounded to 4 places
            assert all(0.5 <= report[f"ours_base_rate.{q}@{v}"] <= 1 for q in per_q)  # two choices at most here
        # The same schedule reached every system; stateless got every 3rd ask of it.
        assert report[f"ours_asks@{v}"] + report[f"ours_adhoc_asks@{v}"] == \
            report[f"prefixcache_asks@{v}"] + report[f"prefixcache_adhoc_asks@{v}"]
    for s in ("ours", "prefixcache", "stateless"):
        assert f"saturation_speed_{s}" in report
    assert report["_meta"]["between_asks"]["prefixcache"].startswith("nothing")
    for name in ("report.md", "latency_vs_feed_rate.png", "latency_vs_context.png"):
        assert (out / name).stat().st_size > 0, name
    text = (out / "report.md").read_text()
    assert "Between asks" in text and "from the push" in text and "Caveats" in text
    if any(report[f"ours_labelled@{v}"] for v in ("1", "20")):  # each question beside its base rate
        assert "Accuracy per question" in text and "| base rate |" in text
    return report


def test_live_replay_on_the_synthetic_feed(tmp_path):
    report = _run(tmp_path, ["--seed", "1", "--speed", "auto", "--capacity-s", "6"])
    assert report["ingest_capacity_speed"] > 0 and f"ours_ms_p50@{report['auto_speed']:g}" in report
    assert report["ours_labelled@1"] >= 1  # 75 s of warm-up in 5 s bars: the labels have their history
    assert report["events_in"] > 0 and report["lines_pushed"] >= report["feed_lines@1"]  # warm-up included
    assert report["sweep_recorded_lines@256"] >= 1 and "sweep_ours_from_push_ms_p50@512" in report


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/binance-spot not present (a fresh clone has none)")
def test_live_replay_on_the_recorded_captures(tmp_path):
    data = [str(SHARED / "btcusdt_20240808.gz"), str(SHARED / "ethusdt_20240808.gz")]
    report = _run(tmp_path, ["--data", *data])
    assert report["feed_lines@1"] >= 1  # 6 s of two instruments in 5 s bars
    # The sweep stops where the recording ends: it never pads with synthetic bars.
    assert report["sweep_recorded_lines@512"] <= report["sweep_lines_available"]


def test_a_crash_mid_run_keeps_what_was_measured(tmp_path, monkeypatch):
    real = bench.replay.run_system

    def crash_on_stateless(system, *args, **kw):
        if system == "stateless":
            raise RuntimeError("boom")
        return real(system, *args, **kw)

    monkeypatch.setattr(bench.replay, "run_system", crash_on_stateless)
    with pytest.raises(RuntimeError, match="boom"):
        cli_main(["--model", "tiny", "--quick", "--speeds", "1", "--duration", "4", "--asks", "4", "--sweep", "",
                  "--systems", "ours,prefixcache,stateless", "--json", str(tmp_path / "r.json"),
                  "--out", str(tmp_path / "o")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert "ours_ms_p50@1" in report and "speedup_vs_prefixcache@1" in report
    assert "stateless_ms_p50@1" not in report


def test_top_alternatives_reads_each_server_format():
    from bench.baselines import top_alternatives

    llama = {"logprobs": {"content": [{"top_logprobs": [{"id": 5, "token": " up", "logprob": -0.5}]}]}}
    openai = {"logprobs": {"top_logprobs": [{" up": -0.5, " down": -1.5}]}}
    native = {"completion_probabilities": [{"probs": [{"id": 5, "tok_str": " up", "prob": 0.5}]}]}
    assert top_alternatives(llama) == [(5, " up", -0.5)]
    assert top_alternatives(openai) == [(None, " up", -0.5), (None, " down", -1.5)]
    assert top_alternatives(native) == [(5, " up", pytest.approx(math.log(0.5)))]
    assert top_alternatives({"text": "up"}) == []


def test_speeds_always_include_real_time_unless_told():
    args = bench.replay.parse_args(["--speeds", "10,60", "--speed", "auto"])
    assert bench.replay.speeds_of(args) == ([1.0, 10.0, 60.0], True)
    args = bench.replay.parse_args(["--speeds", "3600", "--no-realtime"])
    assert bench.replay.speeds_of(args) == ([3600.0], False)
    with pytest.raises(ValueError, match="positive"):
        bench.replay.speeds_of(bench.replay.parse_args(["--speeds", "1,-2"]))



def test_replay_takes_a_bar_table_as_bars(tmp_path):
    """--data BARS.csv on a bars session: every bar becomes a line (it once became none)."""
    csv = tmp_path / "btc-perp_1m.csv"
    rows = [f"{1640991660 + 60 * i},{100 + i % 3},{102 + i % 3},{99 + i % 3},{101 + i % 3},{10 + i}" for i in range(59)]
    csv.write_text("timestamp,open,high,low,close,volume\n" + "\n".join(rows) + "\n")
    questions = Path(__file__).resolve().parents[1] / "queries" / "bars.toml"
    cli_main(["--model", "tiny", "--questions", str(questions), "--data", str(csv), "--speeds", "3600",
              "--no-realtime", "--warmup", "60", "--asks", "5", "--systems", "ours", "--sweep", "",
              "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["events_in"] == 59 and report["lines_pushed"] == 59


def test_a_bar_table_replay_keeps_the_bars_its_labels_read(tiny_model, tmp_path):
    """Ready-made bars (a bar CSV) skip the aggregator; the judge must still see them, or no answer is scored."""
    from bench.live import attachments_for
    from feeds.sources import TableSource
    from streamllm.engine.prompt import PromptLayout
    from tests.test_tune import write_bars

    config = load_config(ROOT / "queries" / "bars.toml")
    att = attachments_for(config, TokenSink(PromptLayout(tiny_model.tokenizer), config))["btc_perp_1m"]
    bars = TableSource(write_bars(tmp_path / "b.csv", 30), "bar", instrument="BTC-PERP").events()
    for ev in bars[:25]:
        att.offer(ev)
    first = att.flush().data_version
    for ev in bars[25:]:
        att.offer(ev)
    last = att.flush().data_version
    assert att.bars == bars and len(att.bars_upto(first)) == 25 and len(att.bars_upto(last)) == 30
    trend = next(q for q in config.sessions[0].questions if q.id == "trend_10m")
    assert trend.expected_answer(att.bars_upto(first)) in ("up", "down")


def test_ours_serves_with_the_configs_adapter(tiny_model, tmp_path, monkeypatch):
    """A tuned config replays with its heads, as serve would: the gate decides from them."""
    from streamllm.model.adapter import save_heads
    from tests.test_tune import CONFIG, random_series, write_bars

    monkeypatch.setattr("streamllm.model.load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    spec = load_config(config).sessions[0]
    save_heads(tmp_path / "ad", random_series(spec, tiny_model.config.hidden_size), model=tiny_model.name)
    config.write_text('[model]\nadapter = "ad"\n' + CONFIG)
    data = write_bars(tmp_path / "bars.csv", 60)
    assert cli_main(["--model", "tiny", "--questions", str(config), "--data", str(data), "--speeds", "60",
                     "--no-realtime", "--warmup", "900", "--duration", "600", "--asks", "6", "--adhoc-rate", "0",
                     "--sweep", "", "--systems", "ours", "--json", str(tmp_path / "r.json"),
                     "--out", str(tmp_path / "o")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["_meta"]["adapter"] == str(tmp_path / "ad") and report["_meta"]["adapter_id"]
    assert report["ours_labelled@60"] >= 1
    assert report["gate_coverage@60"] > 0  # random heads with threshold 0 fire once they have their 6 lines


def test_the_base_rate_is_each_questions_constant_answer_on_the_same_asks() -> None:
    """The accuracy a system must beat: per question (session and id), its most common truth's
    count, summed over questions, over every labelled ask; spellings differ only in case."""
    NS = SimpleNamespace
    trend, spike = NS(id="trend"), NS(id="spike")
    asks = ([NS(session="btc", spec=trend, truth=t) for t in ("up", "Up", "down")]  # up 2 of 3
            + [NS(session="eth", spec=trend, truth="down")]  # its own question: 1 of 1
            + [NS(session="btc", spec=spike, truth=t) for t in ("no",) * 9 + ("yes",)])  # 9 of 10
    assert base_rate(asks) == (2 + 1 + 9) / 14
    assert math.isnan(base_rate([]))


def test_report_folder_without_out_is_named_and_said_in_help(capsys) -> None:
    from bench.replay import DEFAULT_OUT, parse_args, parser

    assert parse_args([]).out == DEFAULT_OUT == "bench-replay-report"
    help_text = " ".join(parser().format_help().split())
    assert "(default: ./bench-replay-report/ in the working directory" in help_text
    assert parse_args(["--out", "elsewhere"]).out == "elsewhere"
