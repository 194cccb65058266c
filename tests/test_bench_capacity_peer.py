"""bench capacity beside a peer: the peer is sent exactly the prompts our engine's entries hold (the same
session ids plus the question's), every bar's standing questions are asked, and a peer too slow for the
pace is reported as not fresh."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from bench.capacity import CONFIG, FREE, FREE_EVERY, cli_main, session_bars
from bench.capacity_peer import _append_bar, peer_sessions
from bench.common import BTC_BARS as BTC
from feeds.tables import TableSource
from streamllm.config import load_config, parse_question
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.prompt import PromptLayout
from streamllm.feeding.attach import Attachment, AttachSpec
from tests.fake_peer import serve

needs_bars = pytest.mark.skipif(not BTC.exists(), reason=f"{BTC} (the shared recorded bars) is not here")


def _args(**kw) -> argparse.Namespace:
    base = {"warmup_bars": 6, "seconds": 2.0, "speed": 120.0, "ramp_s": 2.0, "max_speed": 480.0}
    return argparse.Namespace(**{**base, **kw})


@needs_bars
def test_the_peer_is_sent_the_ids_our_session_holds_and_each_question_as_our_entry_lays_it_out(tiny_model):
    spec = load_config(CONFIG).sessions[0]
    bars = TableSource(BTC, "bar", instrument=spec.instrument).events()[:4000]
    args = _args()
    slices = session_bars(bars, 2, args)
    layout = PromptLayout(tiny_model.tokenizer)
    peers = peer_sessions(layout, spec, slices, parse_question(FREE), FREE_EVERY)
    engine = Engine(tiny_model, EngineConfig(max_cells=16384))
    try:
        for x, own in zip(peers, slices, strict=True):
            engine.open_session(x.name, spec.system_prompt)
            att = Attachment(engine, AttachSpec.of(spec, session=x.name), questions=tuple(spec.questions))
            for bar in own[:args.warmup_bars]:
                att.offer(bar)
                _append_bar(layout, x)
            att.flush()
        engine.wait_idle()
        for x in peers:
            session = engine.sessions[x.name]
            assert x.context == session.token_ids[:session.num_computed]  # the reference: our engine's own ids
    finally:
        engine.shutdown()
    # Session 0 asks the free-text standing question too (one in FREE_EVERY), as ours does; choices ask 1 token
    assert set(peers[0].questions) == {q.id for q in spec.questions} | {FREE["id"]}
    assert set(peers[1].questions) == {q.id for q in spec.questions}
    for q in spec.questions:
        ids, max_tokens = peers[1].questions[q.id]
        assert ids == layout.question_ids(q.text) and max_tokens == 1


def _fake(seen: list[dict], delay_s: float):
    def reply(path: str, body: dict) -> dict:
        time.sleep(delay_s)
        return {"choices": [{"text": " up"}], "usage": {"completion_tokens": body["max_tokens"]}}

    return serve(reply, seen)


@needs_bars
@pytest.mark.parametrize("delay_s, fresh", [(0.0, True), (0.25, False)])
def test_every_bar_asks_each_standing_question_and_a_slow_peer_is_not_fresh(tmp_path: Path, delay_s, fresh):
    seen: list[dict] = []
    server = _fake(seen, delay_s)
    out = tmp_path / "cap.json"
    try:
        assert cli_main(["--model", "tiny", "--sessions", "", "--peer-sessions", "2", "--quick", "--peer-slots", "2",
                         "--peer-workers", "2", "--drain-s", "1", "--peer-url",
                         f"http://127.0.0.1:{server.server_port}", "--json", str(out)]) == 0
    finally:
        server.shutdown()
    report = json.loads(out.read_text())
    assert report["peer_held@2"] == int(fresh) and report["peer_largest_fresh_s"] == (2 if fresh else 0)
    completions = [s for s in seen if s["path"] == "/v1/completions"]
    assert all(s["cache_prompt"] is True and s["temperature"] == 0.0 for s in completions)
    assert {s["id_slot"] for s in completions} == {0, 1}  # session i pinned to slot i % 2
    if fresh:
        # warm-up (one context each) + per bar: 4 labelled questions (session s000 also the free-text one)
        bars = report["peer_bars_answered@2"]
        assert report["peer_stale_bars@2"] == 0 and bars == report["peer_bars_offered@2"] > 0
        standing = [s for s in completions if s["max_tokens"] == 1 and s["prompt"].endswith("assistant\n")]
        assert len(standing) >= 4 * bars  # (and the schedule's asks)
        assert report["peer_freshness_lag_p99_ms@2"] < 500
    else:
        assert report["peer_stale_bars@2"] > 0 or report["peer_freshness_lag_p99_ms@2"] > 500
