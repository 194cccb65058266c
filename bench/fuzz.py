"""The fuzz part of `streamllm bench faults`, and the seed corpora and mutators tests/test_fuzz.py shares.

Seeded random and mutated inputs go into the wire parsers, the protocol decoder and the config
parser; anything but the documented error types is an uncaught error.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

# Real-shaped messages per venue (from each parser's documented formats): mutation seeds.
SAMPLES: dict[str, list[bytes]] = {
    "binance": [
        b'{"stream":"btcusdt@trade","data":{"e":"trade","E":1723161255208,"s":"BTCUSDT","t":1,"p":"61737.63",'
        b'"q":"0.01","T":1723161255207,"m":true,"M":true}}',
        b'{"stream":"btcusdt@bookTicker","data":{"u":50093239212,"s":"BTCUSDT","b":"61837.63","B":"3.7",'
        b'"a":"61837.64","A":"1.5"}}',
        b'{"stream":"btcusdt@depth@100ms","data":{"e":"depthUpdate","E":1723161255208,"s":"BTCUSDT",'
        b'"U":50093239189,"u":50093239202,"b":[["61737.63","0.0"]],"a":[["61837.64","1.5"]]}}',
        b'{"lastUpdateId":5,"bids":[["1.0","2.0"]],"asks":[["1.1","3.0"]]}',
        b'{"e":"kline","E":1,"s":"BTCUSDT","k":{"t":0,"T":59999,"s":"BTCUSDT","i":"1m","o":"1","c":"2","h":"3",'
        b'"l":"0.5","v":"10","n":4,"x":true,"q":"20","V":"5","Q":"10"}}',
        b'{"result":null,"id":1}',
    ],
    "coinbase": [
        b'{"channel":"market_trades","client_id":"","timestamp":"2023-02-09T20:19:35.39625135Z","sequence_num":0,'
        b'"events":[{"type":"update","trades":[{"trade_id":"1","product_id":"BTC-USD","price":"1.5","size":"2",'
        b'"side":"BUY","time":"2023-02-09T20:19:35.39625135Z"}]}]}',
        b'{"channel":"l2_data","timestamp":"2023-02-09T20:19:35Z","sequence_num":1,"events":[{"type":"update",'
        b'"product_id":"BTC-USD","updates":[{"side":"bid","event_time":"2023-02-09T20:19:35Z",'
        b'"price_level":"1.0","new_quantity":"0"}]}]}',
        b'{"type":"error","message":"bad"}',
    ],
    "kraken": [
        b'{"channel":"trade","type":"update","data":[{"symbol":"BTC/USD","side":"sell","price":0.5,"qty":40.0,'
        b'"ord_type":"market","trade_id":4665906,"timestamp":"2023-09-25T07:49:37.708706Z"}]}',
        b'{"channel":"ticker","type":"snapshot","data":[{"symbol":"BTC/USD","bid":1.0,"bid_qty":2.0,"ask":1.1,'
        b'"ask_qty":3.0,"last":1.05,"volume":10.0,"vwap":1.0,"low":0.9,"high":1.2,"change":0.1,"change_pct":1.0}]}',
        b'{"channel":"heartbeat"}',
    ],
    "coinbase-exchange": [
        b'{"type":"match","trade_id":10,"sequence":50,"maker_order_id":"a","taker_order_id":"b",'
        b'"time":"2014-11-07T08:19:27.028459Z","product_id":"BTC-USD","size":"5.23512","price":"400.23","side":"sell"}',
        b'{"type":"ticker","sequence":1,"product_id":"BTC-USD","price":"8500","best_bid":"8500","best_bid_size":"1",'
        b'"best_ask":"8500.01","best_ask_size":"2","time":"2022-01-01T00:00:00Z"}',
        b'{"type":"snapshot","product_id":"BTC-USD","bids":[["10101.10","0.45054140"]],"asks":[["10102.55","0.57753524"]]}',
        b'{"type":"l2update","product_id":"BTC-USD","time":"2019-08-14T20:42:27.265Z",'
        b'"changes":[["buy","10101.80000000","0.162567"]]}',
    ],
    "kraken-v1": [
        b'[0,[["5541.20000","0.15850568","1534614057.321597","s","l",""]],"trade","XBT/USD"]',
        b'[0,["5698.40000","5700.00000","1542057299.545897","1.01234567","0.98765432"],"spread","XBT/USD"]',
        b'[42,["1542057314.748456","1542057360.000000","3586.70000","3586.70000","3586.60000","3586.60000",'
        b'"3586.68894","0.03373000",2],"ohlc-1","XBT/USD"]',
        b'[1234,{"a":[["5541.30000","2.50700000","1534614248.456738"]]},{"b":[["5541.20000","1.52900000",'
        b'"1534614248.765567","r"]],"c":"974942666"},"book-10","XBT/USD"]',
        b'{"event":"subscriptionStatus","status":"error","errorMessage":"Currency pair not supported"}',
    ],
    "bybit": [
        b'{"topic":"publicTrade.BTCUSDT","type":"snapshot","ts":1672304486868,"data":[{"T":1672304486865,'
        b'"s":"BTCUSDT","S":"Buy","v":"0.001","p":"16578.50","L":"PlusTick","i":"20f43950","BT":false}]}',
        b'{"topic":"orderbook.50.BTCUSDT","type":"delta","ts":1672304484978,"data":{"s":"BTCUSDT",'
        b'"b":[["16493.50","0.006"]],"a":[["16611.00","0"]],"u":18521289,"seq":7961638724},"cts":1672304484961}',
        b'{"topic":"tickers.BTCUSDT","type":"snapshot","cs":1,"ts":1673272861686,"data":{"symbol":"BTCUSDT",'
        b'"markPrice":"17217.33","indexPrice":"17227.36","fundingRate":"-0.000212","bid1Price":"17215.50",'
        b'"bid1Size":"84.489","ask1Price":"17216.00","ask1Size":"83.020"}}',
        b'{"topic":"kline.5.BTCUSDT","type":"snapshot","ts":1,"data":[{"start":1672324800000,"end":1672325099999,'
        b'"interval":"5","open":"16649.5","close":"16677","high":"16677","low":"16608","volume":"2.081",'
        b'"confirm":true}]}',
        b'{"success":false,"ret_msg":"error:handler not found","conn_id":"c","op":"subscribe"}',
        b'{"topic":"trade.BTCUSD","data":[{"trade_time_ms":1618677786614,"timestamp":"2021-04-17T16:43:06.000Z",'
        b'"symbol":"BTCUSD","side":"Sell","size":4,"price":60621.5,"tick_direction":"PlusTick","trade_id":"5ffb8b77",'
        b'"cross_seq":5938955347}]}',
        b'{"topic":"orderBookL2_25.BCHUSDT","type":"delta","data":{"delete":[{"price":"1054.30","symbol":"BCHUSDT",'
        b'"id":"10543000","side":"Buy"}],"update":[],"insert":[{"price":"1053.90","symbol":"BCHUSDT",'
        b'"id":"10539000","side":"Sell","size":2.5}]},"cross_seq":"864131773","timestamp_e6":"1618677786389362"}',
    ],
    "okx": [
        b'{"arg":{"channel":"trades","instId":"BTC-USDT"},"data":[{"instId":"BTC-USDT","tradeId":"130639474",'
        b'"px":"42219.9","sz":"0.12060306","side":"buy","ts":"1630048897897"}]}',
        b'{"arg":{"channel":"books","instId":"BTC-USDT"},"action":"update","data":[{"asks":[["8476.98","415","0","13"]],'
        b'"bids":[["8476.97","256","0","12"]],"ts":"1597026383085","checksum":-855196043,"prevSeqId":1,"seqId":2}]}',
        b'{"arg":{"channel":"candle1m","instId":"BTC-USDT"},"data":[["1597026360000","8533","8553.7","8527.1",'
        b'"8548.2","45247","529","529","1"]]}',
        b'{"arg":{"channel":"tickers","instId":"BTC-USDT"},"data":[{"instId":"BTC-USDT","bidPx":"1","bidSz":"2",'
        b'"askPx":"1.1","askSz":"3","ts":"1"}]}',
        b'{"event":"error","code":"60012","msg":"Invalid request"}',
        b'pong',
    ],
    "kraken-futures": [
        b'{"feed":"trade","product_id":"PI_XBTUSD","uid":"b5a1c239","side":"sell","type":"fill","seq":85423,'
        b'"time":1565342712903,"qty":1135.0,"price":11735.0}',
        b'{"feed":"trade_snapshot","product_id":"PI_XBTUSD","trades":[{"feed":"trade","product_id":"PI_XBTUSD",'
        b'"uid":"u","side":"buy","type":"fill","seq":85424,"time":1565342712903,"qty":1.0,"price":11735.5}]}',
        b'{"feed":"book_snapshot","product_id":"PI_XBTUSD","timestamp":1565342712774,"seq":30007298,'
        b'"bids":[{"price":11735.0,"qty":50000.0}],"asks":[{"price":11739.0,"qty":47410.0}],"tickSize":null}',
        b'{"feed":"book","product_id":"PI_XBTUSD","side":"sell","seq":30007299,"price":11741.5,"qty":0.0,'
        b'"timestamp":1565342713929}',
        b'{"feed":"ticker","product_id":"PI_XBTUSD","time":1565342713929,"bid":11735.0,"ask":11739.0,'
        b'"bid_size":50000.0,"ask_size":47410.0,"markPrice":11737.2,"index":11736.4,"funding_rate":1.2e-9,'
        b'"next_funding_rate_time":1565344800000}',
        b'{"event":"alert","message":"Bad request"}',
    ],
    "alpaca": [
        b'[{"T":"success","msg":"connected"}]',
        b'[{"T":"t","i":96921,"S":"AAPL","x":"D","p":126.55,"s":1,"t":"2021-02-22T15:51:44.208Z","c":["@"],"z":"C"}]',
        b'[{"T":"q","S":"AMD","bx":"U","bp":87.66,"bs":1,"ax":"Q","ap":87.68,"as":4,'
        b'"t":"2021-02-22T15:51:45.335689322Z","c":["R"],"z":"C"}]',
    ],
}
CONFIG_SAMPLE = '''[[sessions]]
name = "btc"
instrument = "BTCUSDT"
feed = "synthetic"
max_context_tokens = 4096
system_prompt = "You watch {instrument}."
[sessions.render]
mode = "bars"
bar_seconds = 5
[[sessions.questions]]
id = "trend"
text = "Up or down?"
choices = ["up", "down"]
threshold = 2.0
label = "trend_up(n=10)"
'''
_ODD_VALUES: list[Any] = [None, True, 0, -1, 2**63, 1e308, float("nan"), "", "x" * 300, [], {}, [[]], "1e999",
                          "-0", "NaN", "\u0000", "\ud7ff", {"a": None}]


def mutate_value(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """Structural mutation of parsed JSON: drop, retype or replace one thing, recursively."""
    if isinstance(value, dict) and value and rng.random() < 0.7 and depth < 6:
        key = rng.choice(list(value))
        out = dict(value)
        action = rng.random()
        if action < 0.25:
            del out[key]
        elif action < 0.5:
            out[key] = rng.choice(_ODD_VALUES)
        else:
            out[key] = mutate_value(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7 and depth < 6:
        out = list(value)
        i = rng.randrange(len(out))
        out[i] = mutate_value(rng, out[i], depth + 1) if rng.random() < 0.6 else rng.choice(_ODD_VALUES)
        return out
    return rng.choice(_ODD_VALUES)


def mutated_config(rng: random.Random) -> str:
    """CONFIG_SAMPLE with one to three of its lines mutated."""
    lines = CONFIG_SAMPLE.splitlines()
    for _ in range(rng.randint(1, 3)):
        j = rng.randrange(len(lines))
        lines[j] = mutate_bytes(rng, lines[j].encode()).decode("utf-8", "replace")
    return "\n".join(lines)


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        op, i = rng.random(), rng.randrange(len(data))
        if op < 0.3:
            data[i] = rng.randrange(256)
        elif op < 0.5:
            del data[i:]
        elif op < 0.7:
            data.insert(i, rng.choice(b'{}[]",:0\\'))
        else:
            del data[i]
    return bytes(data)


def mutate(rng: random.Random, raw: bytes) -> bytes:
    """A mutated message: structural (still JSON) or byte-level (usually not)."""
    if rng.random() < 0.6:
        try:
            return orjson.dumps(mutate_value(rng, orjson.loads(raw)))
        except (orjson.JSONDecodeError, TypeError):
            pass
    return mutate_bytes(rng, raw)


def fuzz(cases: int, seed: int = 0) -> dict[str, Any]:
    from feeds.wire import AuthError, parser_for
    from streamllm.config import ConfigError, parse_config
    from streamllm.service import protocol as p

    rng = random.Random(seed)
    uncaught: list[str] = []
    rejected = counted = 0
    venues = list(SAMPLES)
    per_target = max(1, cases // 3)
    for i in range(per_target):  # wire parsers
        venue = venues[i % len(venues)]
        parser = parser_for(venue)
        raw = mutate(rng, rng.choice(SAMPLES[venue])) if rng.random() < 0.85 else rng.randbytes(rng.randint(0, 64))
        before = parser.stats.errors
        try:
            out = parser.parse(raw, 0)
        except AuthError:
            continue  # documented: a credential refusal ends the connection on purpose
        except Exception as exc:
            uncaught.append(f"{venue} parser: {type(exc).__name__}: {exc} on {raw[:80]!r}")
            continue
        if not isinstance(out, list):
            uncaught.append(f"{venue} parser returned {type(out).__name__}")
        if parser.stats.errors > before:
            rejected += 1
            counted += bool(parser.stats.error_samples)
    for _ in range(per_target):  # protocol decoder
        base = {"type": rng.choice(p.CLIENT_TYPES), "id": rng.randint(0, 9), "session": "btc", "lines": ["x"]}
        raw = mutate(rng, orjson.dumps(base))
        try:
            p.decode(raw, 4096)
        except p.ProtocolError as exc:
            rejected += 1
            counted += exc.code in p.ERROR_CODES and bool(exc.message)
        except Exception as exc:
            uncaught.append(f"protocol: {type(exc).__name__}: {exc} on {raw[:80]!r}")
    for _ in range(per_target):  # config files
        try:
            parse_config(mutated_config(rng), source="fuzz.toml")
        except ConfigError as exc:
            rejected += 1
            counted += bool(str(exc))
        except Exception as exc:
            uncaught.append(f"config: {type(exc).__name__}: {exc}")
    return {"fuzz_cases": 3 * per_target, "fuzz_rejected": rejected, "fuzz_rejected_counted": counted,
            "uncaught_errors": len(uncaught), "uncaught_samples": uncaught[:10]}
