"""Alpaca market data v2 websocket: wire parser and protocol.

URL wss://stream.data.alpaca.markets/v2/{iex|sip} (crypto: /v1beta3/crypto/us). Every
server message is a JSON array of objects tagged by "T" (Alpaca "Real-time stock data" docs):
  control  [{"T":"success","msg":"connected"}], [{"T":"success","msg":"authenticated"}],
           [{"T":"error","code":402,"msg":"auth failed"}], [{"T":"subscription","trades":[..],..}]
  t  trade {"T":"t","i":96921,"S":"AAPL","x":"D","p":126.55,"s":1,"t":"2021-02-22T15:51:44.208Z",
           "c":["@","I"],"z":"C"}   (crypto adds "tks": "B"|"S", the taker side)
  q  quote {"T":"q","S":"AMD","bx":"U","bp":87.66,"bs":1,"ax":"Q","ap":87.68,"as":4,
           "t":"2021-02-22T15:51:45.335689322Z","c":["R"],"z":"C"}
  b  bar   {"T":"b","S":"SPY","o":388.985,"h":389.13,"l":388.975,"c":389.12,"v":49378,
           "t":"2021-02-22T19:15:00Z","n":461,"vw":389.062639}   (minute bar, t = start)
Flow: connect -> "connected"; send {"action":"auth","key":..,"secret":..} -> "authenticated"
or error 402/401/404; then {"action":"subscribe","trades":[..],"quotes":[..],"bars":[..]}.
Error codes: 400 invalid syntax, 401 not authenticated, 402 auth failed, 403 already
authenticated, 404 auth timeout, 405 symbol limit, 406 connection limit, 407 slow client,
409 insufficient subscription, 500 internal error.
"""

from __future__ import annotations

from typing import Any

from feeds.events import BUY, SELL, UNKNOWN_SIDE, Bar, Quote, Trade, float_decimals
from feeds.validate import check_bar, error_kind, nonnegative, positive
from feeds.wire import AuthError, Loads, ParseStats, VenueError, fast_loads, rfc3339_ns

VENUE = "alpaca"
DEFAULT_URL = "wss://stream.data.alpaca.markets/v2/iex"
MIN_NS = 60 * 1_000_000_000
AUTH_CODES = {401, 402, 404}
_SIDES = {"B": BUY, "S": SELL}


class AlpacaParser:
    venue = VENUE

    def __init__(self, loads: Loads = fast_loads) -> None:
        self.loads = loads
        self.stats = ParseStats()
        self.connected = False
        self.authenticated = False
        self.subscription: dict[str, Any] = {}

    def parse(self, raw: str | bytes, ts_recv: int) -> list[Any]:
        self.stats.messages += 1
        out: list[Any] = []
        try:
            msgs = self.loads(raw)
            if not isinstance(msgs, list):
                raise ValueError("alpaca messages are JSON arrays")
        except (ValueError, TypeError) as exc:
            self.stats.error(f"alpaca {type(exc).__name__} {exc}", raw, error_kind(exc))
            return out
        # A batch holds many items: a bad one is counted and the rest still parse.
        for m in msgs:
            try:
                ev = self._item(m, ts_recv)
            except AuthError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError, VenueError) as exc:
                self.stats.error(f"alpaca {type(exc).__name__} {exc}", raw, error_kind(exc))
                continue
            if ev is not None:
                out.append(ev)
        self.stats.events += len(out)
        return out

    def _item(self, m: dict[str, Any], ts_recv: int) -> Any:
        kind = m["T"]
        if kind == "t":
            p, s = m["p"], m["s"]
            return Trade(VENUE, m["S"], rfc3339_ns(m["t"]), ts_recv, positive("price", float(p)),
                         positive("size", float(s)),
                         _SIDES.get(m.get("tks", ""), UNKNOWN_SIDE), m["i"], float_decimals(p),
                         float_decimals(s))
        if kind == "q":
            bp, ap, bs, as_ = m["bp"], m["ap"], m["bs"], m["as"]
            return Quote(VENUE, m["S"], rfc3339_ns(m["t"]), ts_recv, positive("bid", float(bp)),
                         nonnegative("bid_size", float(bs)), positive("ask", float(ap)),
                         nonnegative("ask_size", float(as_)), max(float_decimals(bp), float_decimals(ap)),
                         max(float_decimals(bs), float_decimals(as_)))
        if kind in ("b", "u", "d"):
            # b: minute bar; u: corrected minute bar; d: daily bar
            interval = 1440 * MIN_NS if kind == "d" else MIN_NS
            open_ns = rfc3339_ns(m["t"])
            o, h, lo, c, v = m["o"], m["h"], m["l"], m["c"], m["v"]
            check_bar(float(o), float(h), float(lo), float(c), float(v))
            nan = float("nan")  # no buy/sell split in Alpaca bars
            return Bar(VENUE, m["S"], open_ns + interval, ts_recv, open_ns, interval, float(o),
                       float(h), float(lo), float(c), float(v), int(m.get("n", -1)), nan, nan,
                       float(m.get("vw", nan)),
                       max(float_decimals(o), float_decimals(h), float_decimals(lo), float_decimals(c)),
                       float_decimals(v))
        if kind == "success":
            self.stats.aside("connection reply")
            if m.get("msg") == "connected":
                self.connected = True
            elif m.get("msg") == "authenticated":
                self.authenticated = True
            return None
        if kind == "subscription":
            self.stats.aside("subscription reply")
            self.subscription = {k: v for k, v in m.items() if k != "T"}
            return None
        if kind == "error":
            code = int(m.get("code", 0))
            if code in AUTH_CODES:
                raise AuthError(f"alpaca auth error {code}: {m.get('msg')}")
            raise VenueError(f"alpaca error {code}: {m.get('msg')}")
        raise ValueError(f"unknown alpaca message type {kind!r}")


def auth_message(key: str, secret: str) -> dict[str, Any]:
    return {"action": "auth", "key": key, "secret": secret}


def subscribe_message(symbols: list[str], channels: list[str]) -> dict[str, Any]:
    """channels among 'trades', 'quotes', 'bars'."""
    return {"action": "subscribe", **{ch: list(symbols) for ch in channels}}


DEFAULT_CHANNELS = ["trades", "quotes"]
