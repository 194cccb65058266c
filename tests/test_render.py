"""Rendering: deterministic compact lines; token budget checked with the real tokenizer."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from feeds.bars import bars
from feeds.events import BUY, SELL, Bar, Quote, Trade
from feeds.synthetic import synthetic_events
from streamllm.feeding.render import Renderer, quantity, render_lines

S = 1_000_000_000
T0 = 1_723_161_600 * S  # 2024-08-09 00:00 UTC
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _bar(minute: int, o: float, h: float, lo: float, c: float, v: float, n: int = 10, buy: float = 0.0) -> Bar:
    t = T0 + minute * 60 * S
    return Bar("t", "BTCUSDT", t + 60 * S, t + 60 * S, t, 60 * S, o, h, lo, c, v, n, buy, v - buy, c, 2, 5)


def test_bar_lines_are_lossless_and_compact() -> None:
    lines = render_lines([
        _bar(0, 61685.99, 61700.00, 61680.00, 61690.50, 12.34567, 321, 6.0),
        _bar(1, 61690.50, 61690.50, 61650.25, 61660.00, 1_834_512.0, 5, 0.0),
        _bar(2, 61661.00, 61661.00, 61661.00, 61661.00, 0.5, 1, 0.5),
    ])
    assert lines == [
        "2024-08-09T00:00 61690.5 +4.51 h+9.5 l-5.99 v12.3 n321 b49",
        "00:01 61660 -30.5 l-9.75 v1.83M n5 b0",
        "00:02 61661 +1 o+1 v0.5 n1 b100",
    ]


def test_empty_bars_and_gap_span() -> None:
    r = Renderer()
    r.render(_bar(0, 10, 11, 9, 10.5, 1.0))
    empty = Bar("t", "BTCUSDT", T0 + 2 * 60 * S, 0, T0 + 60 * S, 60 * S, 10.5, 10.5, 10.5, 10.5, 0, 0, 0, 0, 10.5)
    assert r.render(empty) == "00:01 10.5 no trades"
    gap = Bar("t", "BTCUSDT", T0 + 20 * 60 * S, 0, T0 + 2 * 60 * S, 18 * 60 * S, 10.5, 10.5, 10.5, 10.5, 0, 0, 0, 0, 10.5)
    assert r.render(gap) == "00:02-00:20 10.5 no trades"


def test_trade_quote_lines_and_symbol() -> None:
    r = Renderer(with_symbol=True)
    t = Trade("binance", "BTCUSDT", T0 + 1_500_000_000, 0, 61685.99, 0.00017, SELL, 1, 2, 5)
    q = Quote("binance", "BTCUSDT", T0 + 2 * S, 0, 61685.99, 1.25869, 61686.0, 2.4, 2, 5)
    assert r.render(t) == "2024-08-09T00:00:01 BTCUSDT sell 61685.99 0.00017"
    assert r.render(q) == "00:00:02 BTCUSDT bid 61685.99 x1.25869 ask 61686 x2.4"
    assert Renderer(precision={"X": (0, 0)}).render(Trade("v", "X", 0, 0, 10.4, 2.0, BUY, 1, 2, 2)).endswith("buy 10 2")


def test_quantity_units() -> None:
    assert [quantity(x) for x in (0, 0.000123456, 12.34567, 999.96, 466_000, 2_300_413.7, 4.2e9)] == [
        "0", "0.000123", "12.3", "1000", "466K", "2.3M", "4.2B"]


def test_rendering_is_deterministic() -> None:
    evs = synthetic_events(seed=3, duration_s=120)
    assert render_lines(bars(evs, 60)) == render_lines(bars(synthetic_events(seed=3, duration_s=120), 60))


@pytest.mark.integration
@pytest.mark.skipif(not (DATA / "bars").exists(), reason=f"shared bars CSV not found at {DATA / 'bars'}")
def test_one_minute_bar_line_within_token_budget() -> None:
    from feeds.sources import TableSource
    from streamllm.model import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    csv = TableSource(DATA / "bars" / "btc-perp-20211231-20220201_1m.csv", "bar").events()[:2000]
    counts = [len(tok(line, add_special_tokens=False)["input_ids"]) for line in render_lines(csv)]
    assert statistics.mean(counts) <= 24


def test_bp_changes_write_a_move_alike_on_every_price_level() -> None:
    """`changes = "bp"`: change and o/h/l offsets in basis points of the previous close, two
    significant digits; the same 0.1% move reads the same at any price level."""
    for level in (61690.5, 4321.0, 195.38):
        prev = _bar(0, level, level, level, level, 1.0)
        up = _bar(1, level * 1.0005, level * 1.002, level * 0.9995, level * 1.001, 2.0)
        r = Renderer(changes="bp")
        r.render(prev)
        assert r.render(up).split()[2:6] == ["+10", "o+5", "h+10", "l-10"]
    lines = render_lines([
        _bar(0, 61685.99, 61700.00, 61680.00, 61690.50, 12.34567, 321, 6.0),
        _bar(1, 61690.50, 61690.50, 61650.25, 61660.00, 1_834_512.0, 5, 0.0),
        _bar(2, 61661.00, 61661.00, 61661.00, 61661.00, 0.5, 1, 0.5),
    ], changes="bp")
    assert lines == [  # the close keeps the venue's precision; the first bar's move is from its open
        "2024-08-09T00:00 61690.5 +0.73 h+1.5 l-0.97 v12.3 n321 b49",
        "00:01 61660 -4.9 l-1.6 v1.83M n5 b0",
        "00:02 61661 +0.16 o+0.16 v0.5 n1 b100",
    ]
    # Below zero (WTI, April 2020): a rise still reads +, a fall -, in bp of the price's size.
    r = Renderer(changes="bp")
    r.render(_bar(0, -10.0, -10.0, -10.0, -10.0, 1.0))
    assert r.render(_bar(1, -10.0, -9.0, -10.0, -9.0, 1.0)).split()[2] == "+1000"
    assert r.render(_bar(2, -9.0, -9.0, -9.9, -9.9, 1.0)).split()[2] == "-1000"
