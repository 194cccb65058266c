"""cryptofeed adapter: its normalized objects into our events (offline), config and lazy import."""

from __future__ import annotations

import math
import subprocess
import sys
from decimal import Decimal

import pytest

from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, Liquidation, Mark, Quote, Trade
from streamllm.config import parse_config
from streamllm.feeding.render import Renderer

S = 1_000_000_000


def test_importing_the_adapter_does_not_import_cryptofeed() -> None:
    code = "import sys, feeds.cryptofeed_adapter; print('cryptofeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_config_takes_a_cryptofeed_exchange() -> None:
    cfg = parse_config('[[sessions]]\nname = "btc"\ninstrument = "BTC-USD-PERP"\nfeed = "cryptofeed:kraken_futures"\n')
    feed = cfg.sessions[0].feed
    assert (feed.kind, feed.exchange, feed.symbols, str(feed)) == (
        "cryptofeed", "KRAKEN_FUTURES", ("BTC-USD-PERP",), "cryptofeed:KRAKEN_FUTURES")
    with pytest.raises(ValueError, match="needs an exchange"):
        parse_config('[[sessions]]\nname = "b"\ninstrument = "X"\nfeed = "cryptofeed"\n')


cf_types = pytest.importorskip("cryptofeed.types", reason="cryptofeed not installed (pip install 'streamllm[cryptofeed]')")


def test_normalize_each_type_value_by_value() -> None:
    from feeds.cryptofeed_adapter import normalize

    (t,) = normalize(cf_types.Trade("BYBIT", "BTC-USDT-PERP", "sell", Decimal("0.500"), Decimal("61837.60"),
                                    1700000000.25, id="77", type=None, raw=None), 5)
    assert type(t) is Trade
    assert (t.venue, t.instrument, t.price, t.size, t.side, t.trade_id, t.ts_event, t.ts_recv, t.px_dp, t.sz_dp) == (
        "bybit", "BTC-USDT-PERP", 61837.6, 0.5, SELL, "77", 1700000000_250_000_000, 5, 1, 1)
    (u,) = normalize(cf_types.Trade("GEMINI", "BTC-USD", None, Decimal("1"), Decimal("2"), 1.5, raw=None), 9)
    assert (u.side, u.ts_event, u.trade_id) == (UNKNOWN_SIDE, 1_500_000_000, "")
    (q,) = normalize(cf_types.Ticker("OKX", "ETH-USDT", Decimal("2000.15"), Decimal("2000.2"), 1700000000.5,
                                     raw=None), 5)
    assert type(q) is Quote and (q.bid, q.ask, q.px_dp, q.ts_event) == (2000.15, 2000.2, 2, 1700000000_500_000_000)
    assert math.isnan(q.bid_size) and Renderer().render(q) == "2023-11-14T22:13:20 bid 2000.15 ask 2000.2"
    candle = cf_types.Candle("KRAKEN", "BTC-USD", 1700000040, 1700000099.999, "1m", 12, Decimal("100.5"),
                             Decimal("101"), Decimal("101.25"), Decimal("100"), Decimal("3.5"), True, 1700000100.0,
                             raw=None)
    (b,) = normalize(candle, 5)
    assert type(b) is Bar
    assert (b.ts_open, b.interval_ns, b.ts_event, b.open, b.high, b.low, b.close, b.volume, b.trades, b.px_dp) == (
        1700000040 * S, 60 * S, 1700000100 * S, 100.5, 101.25, 100.0, 101.0, 3.5, 12, 2)
    assert math.isnan(b.buy_volume)
    (liq,) = normalize(cf_types.Liquidation("BINANCE_FUTURES", "BTC-USDT-PERP", "buy", Decimal("0.01"),
                                            Decimal("60000.1"), "1", "filled", 1700000000.0, raw=None), 5)
    assert type(liq) is Liquidation and (liq.side, liq.price, liq.size) == (BUY, 60000.1, 0.01)
    (m,) = normalize(cf_types.Funding("BITMEX", "BTC-USD-PERP", Decimal("61000.5"), Decimal("0.0001"),
                                      1700003600.0, 1700000000.0, predicted_rate=None, raw=None), 5)
    assert type(m) is Mark and (m.mark, m.funding_rate, m.next_funding_ns) == (61000.5, 0.0001, 1700003600 * S)
    assert math.isnan(m.index)


def test_impossible_values_and_open_candles() -> None:
    from feeds.cryptofeed_adapter import normalize
    from feeds.validate import BadValue

    with pytest.raises(BadValue, match="bad_price"):
        normalize(cf_types.Trade("BYBIT", "X", "buy", Decimal("1"), Decimal("-1"), 1.0, raw=None), 1)
    bad = cf_types.Candle("KRAKEN", "X", 0, 59.999, "1m", 1, Decimal("1"), Decimal("1"), Decimal("0.5"),
                          Decimal("0.9"), Decimal("1"), True, 60.0, raw=None)  # high < low
    with pytest.raises(BadValue, match="bad_bar"):
        normalize(bad, 1)
    open_candle = cf_types.Candle("KRAKEN", "X", 0, 59.999, "1m", 1, Decimal("1"), Decimal("1"), Decimal("1"),
                                  Decimal("1"), Decimal("1"), False, 30.0, raw=None)
    assert normalize(open_candle, 1) == []


def test_adapter_refuses_unknown_exchange_and_channel() -> None:
    from feeds.cryptofeed_adapter import CryptofeedAdapter

    with pytest.raises(ValueError, match="cryptofeed has no exchange 'nope'; one of .*KRAKEN_FUTURES"):
        CryptofeedAdapter("nope", ["BTC-USD"])
    with pytest.raises(ValueError, match="channels"):
        CryptofeedAdapter("KRAKEN", ["BTC-USD"], ["l3_book"])
    a = CryptofeedAdapter("kraken", ["BTC-USD"])
    assert a.exchange == "KRAKEN" and a.channels == ["trades", "ticker"]
