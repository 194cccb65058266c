"""`streamllm record` names raw files after the venue's stream symbols: a hostile or odd symbol
must never write outside `--out`, and its message must still be kept (in the venue's file)."""

from __future__ import annotations

import gzip
import json

import pytest

from feeds.recorder import Recorder, plain_name

NS = 1_000_000_000
RECV_NS = 1_723_075_200 * NS  # 2024-08-08 00:00 UTC
DAY = "20240808"


def message(stream: str, n: int) -> str:
    return json.dumps({"stream": stream, "data": {"e": "trade", "t": n}})


def lines(path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


@pytest.mark.parametrize(
    ("name", "plain"),
    [("btcusdt", True), ("BTC-USD", True), ("btc_usd.p", True), ("..", False), ("a..b", False),
     (".hidden", False), ("../x", False), ("/etc", False), ("a/b", False), ("a\\b", False), ("", False),
     ("x" * 64, True), ("x" * 65, False), ("btc\x00", False), ("btcusdt\n", False)],
)
def test_plain_names(name, plain):
    assert plain_name(name) is plain


def test_hostile_symbols_stay_inside_out_and_nothing_is_lost(tmp_path):
    out = tmp_path / "out"
    rec = Recorder(out, "binance", symbols=["BTCUSDT"])
    streams = ["btcusdt@trade", "../../escape@trade", "/tmp/abs@trade", "..@trade", ".hidden@trade",
               "x" * 100 + "@trade", "ethusdt@trade", "a/../../b@trade", "btcusdt@depth@100ms"]
    for n, stream in enumerate(streams):
        rec.on_raw(RECV_NS + n, message(stream, n))
    rec.on_raw(RECV_NS + 99, '{"result":null,"id":1}')  # no stream: the venue's file
    rec.close()
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == [f"out/raw/binance_{DAY}.gz", f"out/raw/btcusdt_{DAY}.gz"]
    assert [json.loads(ln.split(" ", 1)[1])["stream"] for ln in lines(out / "raw" / f"btcusdt_{DAY}.gz")] == [
        "btcusdt@trade", "btcusdt@depth@100ms"]
    venue_file = lines(out / "raw" / f"binance_{DAY}.gz")
    assert len(venue_file) == len(streams) - 2 + 1 and rec.raw_lines == len(streams) + 1
    assert [int(ln.split(" ", 1)[0]) - RECV_NS for ln in venue_file] == [1, 2, 3, 4, 5, 6, 7, 99]


def test_a_file_that_resolves_outside_out_is_refused(tmp_path):
    out = tmp_path / "out"
    rec = Recorder(out, "binance")
    outside = tmp_path / "elsewhere.gz"
    (out / "raw" / f"btcusdt_{DAY}.gz").symlink_to(outside)
    with pytest.raises(ValueError, match="outside"):
        rec.on_raw(RECV_NS, message("btcusdt@trade", 0))
    rec.close()
    assert not outside.exists()


def test_a_venue_that_cannot_name_a_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot name a file"):
        Recorder(tmp_path, "../binance")
