"""bench replay: the load generator, the baselines and a short end-to-end replay (tiny model)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from bench.baselines import Peer, PrefixCache, Stateless, common_prefix
from bench.loadgen import poisson_schedule
from bench.replay import cli_main, matches
from streamllm.engine import Engine

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "binance-spot"
KEYS = ("ours_ms_p50", "ours_ms_p99", "ours_fast_ms_p50", "stateless_ms_p50", "prefixcache_ms_p50",
        "speedup_vs_prefixcache", "gate_coverage", "gate_precision", "lag_versions_p50",
        "ours_latency_ms_p50@256", "prefixcache_latency_ms_p50@256", "stateless_latency_ms_p50@256")
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
    eng = Engine(tiny_model, max_cells=8192, max_context=2048, branch_cells=1024)
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

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            seen.append({"path": self.path, **json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            body = json.dumps({"choices": [{"text": " up"}], "usage": {"completion_tokens": 1},
                               "timings": {"prompt_n": 7}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tok = tiny_model.tokenizer
        ids = tok("hello there", add_special_tokens=False)["input_ids"]
        ans = Peer(f"http://127.0.0.1:{server.server_port}", tok).answer(ids, ids, 3)
    finally:
        server.shutdown()
    assert ans.text == "up" and ans.tokens_computed == 8
    assert seen[0]["path"] == "/v1/completions" and seen[0]["cache_prompt"] is True
    assert seen[0]["prompt"] == tok.decode(ids + ids) and seen[0]["max_tokens"] == 3


def _run(tmp_path: Path, extra: list[str]) -> dict:
    out = tmp_path / "report"
    rc = cli_main(["--model", "tiny", "--speed", "60", "--rate", "8", "--sweep", "256,512", "--sweep-reps", "1",
                   "--stateless-asks", "2", "--json", str(tmp_path / "report.json"), "--out", str(out), *extra])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    for key in KEYS:
        assert key in report, key
    assert report["asks"] >= 1 and report["asks_ok"] == report["asks"]
    assert report["prefixcache_asks"] == report["asks_ok"] and report["stateless_asks"] >= 1
    for name in ("report.md", "latency_vs_context.png", "latency_cdf.png", "gate_risk_coverage.png"):
        assert (out / name).stat().st_size > 0, name
    text = (out / "report.md").read_text()
    assert "stateless" in text and "prefix cache" in text and "Caveats" in text
    return report


def test_replay_on_the_synthetic_feed(tmp_path):
    report = _run(tmp_path, ["--duration", "90", "--seed", "1"])
    assert report["events_in"] > 0 and report["lines_pushed"] > 0
    assert report["labelled_asks"] >= 1  # 90 s of 5 s bars: the labels have their history


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/binance-spot not present (a fresh clone has none)")
def test_replay_on_a_slice_of_a_capture(tmp_path):
    data = [str(SHARED / "btcusdt_20240808.gz"), str(SHARED / "ethusdt_20240808.gz")]
    report = _run(tmp_path, ["--data", *data, "--duration", "60"])
    assert report["lines_pushed"] >= 10  # 60 s of two instruments in 5 s bars


def test_replay_takes_a_bar_table_as_bars(tmp_path):
    """--data BARS.csv on a bars session: every bar becomes a line (it once became none)."""
    csv = tmp_path / "btc-perp_1m.csv"
    rows = [f"{1640991660 + 60 * i},{100 + i % 3},{102 + i % 3},{99 + i % 3},{101 + i % 3},{10 + i}" for i in range(59)]
    csv.write_text("timestamp,open,high,low,close,volume\n" + "\n".join(rows) + "\n")
    questions = Path(__file__).resolve().parents[1] / "queries" / "bars.toml"
    report = _run(tmp_path, ["--questions", str(questions), "--data", str(csv), "--speed", "3600",
                             "--duration", "3600"])
    assert report["events_in"] == 59 and report["lines_pushed"] == 59
