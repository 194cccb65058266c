"""bench query beside a peer: the peer is sent the same ids as text, its cache reset to the context
before every ask (so it computes the question anew), and both decode figures come from the same rule."""

from __future__ import annotations

import json
import time

from bench.baselines import Peer
from bench.query import cli_main, computed_tokens, peer_ask
from tests.fake_peer import serve


def fake_peer(seen: list[dict], usage_only: bool = False):
    def reply(path: str, body: dict) -> dict:
        if path == "/tokenize":
            return {"tokens": []}
        time.sleep(0.002 * body["max_tokens"])  # a server that takes time per token
        if usage_only:  # vLLM's shape: what it found cached is in the usage
            return {"choices": [{"text": " up"}], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 100,
                                                             "prompt_tokens_details": {"cached_tokens": 80}}}
        return {"choices": [{"text": " up"}], "usage": {"completion_tokens": body["max_tokens"]},
                "timings": {"prompt_n": 21, "predicted_per_token_ms": 5.0}}

    return serve(reply, seen)


def test_query_bench_asks_the_peer_in_turn_with_its_cache_reset(tmp_path, capsys):
    seen: list[dict] = []
    server = fake_peer(seen)
    out = tmp_path / "q.json"
    try:
        assert cli_main(["--model", "tiny", "--contexts", "64,128", "--reps", "2", "--stateless-reps", "1",
                         "--decode-steps", "4", "--prefill-tokens", "32", "--no-compare-dtypes",
                         "--peer-url", f"http://127.0.0.1:{server.server_port}", "--json", str(out)]) == 0
    finally:
        server.shutdown()
    metrics = json.loads(out.read_text())
    for key in ("peer_ask_ms_p50@64", "peer_ask_ms_p50@128", "ask_vs_peer@64", "engine_decode_ms", "peer_decode_ms",
                "decode_vs_peer"):
        assert metrics[key] > 0, key
    assert metrics["peer_prompt_tokens@64"] == 21 and metrics["peer_decode_ms_reported"] == 5.0
    completions = [s for s in seen if s["path"] == "/v1/completions"]
    assert all(s["cache_prompt"] is True and s["temperature"] == 0.0 for s in completions)
    # every ask is preceded by the context alone, which the ask's prompt extends
    asks = [i for i, s in enumerate(completions) if i and s["prompt"] != completions[i - 1]["prompt"]
            and s["prompt"].startswith(completions[i - 1]["prompt"])]
    assert len(asks) >= 2 * 3 + 4
    assert "ours vs the peer" in capsys.readouterr().out


def test_what_a_peer_computed_comes_from_its_timings_or_its_cached_tokens(tiny_model):
    for usage_only, computed in ((False, 21), (True, 20)):
        seen: list[dict] = []
        server = fake_peer(seen, usage_only)
        try:
            peer = Peer(f"http://127.0.0.1:{server.server_port}", tiny_model.tokenizer)
            ms, reply = peer_ask(peer, [5, 6, 7], [8, 9], 1)
            got = computed_tokens(reply)
        finally:
            server.shutdown()
        assert got == computed and ms > 0
        assert [s["prompt"] for s in seen] == [tiny_model.tokenizer.decode([5, 6, 7]),
                                               tiny_model.tokenizer.decode([5, 6, 7, 8, 9])]
