"""`streamllm demo`: the whole loop end to end on the tiny model, and the truths it prints beside
free-text answers (the reference: bars aggregated independently from the same trades)."""

from __future__ import annotations

import re

from feeds.bars import bars
from feeds.events import Trade
from feeds.synthetic import synthetic_events
from streamllm.cli.demo import main as cli_main
from streamllm.config import load_config
from streamllm.demo import ADHOC, DEFAULT_CONFIG, Witness, names_number
from streamllm.engine import Engine, EngineConfig
from streamllm.feeding.attach import AttachSpec
from streamllm.feeding.render import fixed


def test_an_answer_is_right_only_when_it_names_the_true_number() -> None:
    assert names_number("The highest close so far is 60000.56.", "60000.56")
    assert names_number("60,000.56", "60000.56") and names_number("It is 2600.7 now", "2600.7")
    assert not names_number("The highest close so far is 60000", "60000.56")  # cut short: wrong
    assert not names_number("The last close price is 2024-01-01T00:00:5", "60077.25")
    assert not names_number("no number at all", "1")
    assert names_number("-0.5 bp", "-0.5") and not names_number("0.5", "-0.5")


def test_the_witness_knows_each_pushed_versions_last_and_highest_close(tiny_model) -> None:
    spec = load_config(DEFAULT_CONFIG).sessions[0]
    trades = [e for e in synthetic_events(seed=3, duration_s=150) if isinstance(e, Trade)
              and e.instrument == spec.instrument]
    engine = Engine(tiny_model, EngineConfig(max_cells=4096, max_context=2048))
    try:
        engine.open_session(spec.name)
        witness = Witness(engine, AttachSpec.of(spec))
        for k, ev in enumerate(trades):
            witness.offer(ev)
            if k % 40 == 39:
                witness.tick(ev.ts_recv)
                witness.flush()
        witness.tick(trades[-1].ts_event + 10 * 10**9)
        witness.flush()
    finally:
        engine.shutdown()
    traded = [b for b in bars(trades, 5) if b.trades > 0]
    assert len(witness.closes) >= 10
    last_version = max(witness.closes)
    assert witness.closes[last_version][:2] == (traded[-1].close, max(b.close for b in traded))
    highs = [witness.closes[v][1] for v in sorted(witness.closes)]
    assert highs == sorted(highs)  # "so far": never falls
    closes = {b.close for b in traded}
    assert all(last in closes for last, _, _ in witness.closes.values())
    dp = witness.closes[last_version][2]
    assert witness.truth(ADHOC, last_version) == fixed(max(b.close for b in traded), dp)
    assert witness.truth("last_close", last_version) == fixed(traded[-1].close, dp)
    assert witness.truth("trend", last_version) is None and witness.truth(ADHOC, last_version + 99) is None


def test_the_demo_runs_end_to_end_and_judges_its_free_text_asks(capsys) -> None:
    assert cli_main(["--model", "tiny", "--duration", "8", "--speed", "5", "--ask-every", "2", "--no-live"]) == 0
    out = capsys.readouterr().out
    judged = re.findall(r"ask \w+: '(?:last_close|What was the highest[^']*)' -> .* (right|wrong): -?[\d.]+$",
                        out, flags=re.M)
    assert judged  # every free-text number ask carries its truth
    summary = re.search(r"free-text number asks: right (\d+) of (\d+)", out)
    assert summary and int(summary[2]) == len(judged) and int(summary[1]) == judged.count("right")
    assert "every event accounted: True" in out


def test_demo_runs_the_configs_own_feed_and_refuses_one_needing_the_network(tmp_path, capsys) -> None:
    bars = tmp_path / "bars.csv"
    bars.write_text("timestamp,open,high,low,close,volume\n" + "".join(
        f"2024-01-02 10:{i:02d}:00,{100 + i},{101 + i},{99 + i},{100.5 + i},{10 + i}\n" for i in range(30)))
    config = tmp_path / "recorded.toml"
    config.write_text('[[sessions]]\nname = "rec"\ninstrument = "TEST"\nfeed = "csv:bars.csv"\n'
                      '[sessions.render]\nmode = "bars"\nbar_seconds = 60\n'
                      '[[sessions.questions]]\nid = "trend"\ntext = "Up or down?"\nchoices = ["up", "down"]\n'
                      'label = "trend_up(n=5)"\n')
    argv = ["--config", str(config), "--model", "tiny", "--duration", "6", "--speed", "3000", "--ask-every", "100",
            "--no-live"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "feeds: csv:" in out and "bars.csv (rec)" in out
    # The file's 30 bars, one line each: not the synthetic market's trades.
    assert "rec: 30 events in, 30 lines pushed" in out and "every event accounted: True" in out
    live = tmp_path / "live.toml"
    live.write_text('[[sessions]]\nname = "btc"\ninstrument = "BTCUSDT"\nfeed = "binance"\n')
    assert cli_main(["--config", str(live), "--model", "tiny", "--no-live"]) == 2
    captured = capsys.readouterr()
    assert "session(s) btc take feed binance, which needs the network" in captured.err
    assert "streamllm serve --config FILE" in captured.err and "loading" not in captured.out
