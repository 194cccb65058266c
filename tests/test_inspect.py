"""`streamllm inspect`: report keys, per-stream values, and refusals with exit codes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from streamllm.cli import main

S = 1_000_000_000


def test_inspect_capture_json_and_text(tmp_path: Path, capsys) -> None:
    cap = tmp_path / "btcusdt_x.gz"
    lines = [
        '1000 {"u":1,"s":"BTCUSDT","b":"100.5","B":"1","a":"100.6","A":"2"}',
        '2000 {"e":"trade","E":1,"s":"BTCUSDT","t":5,"p":"100.55","q":"0.5","T":1700000000000,"m":false}',
        '3000 {"e":"trade","E":1,"s":"BTCUSDT","t":7,"p":"100.6","q":"0.1","T":1700000001000,"m":true}',
        '4000 {"e":"trade","E":1,"s":"BTCUSDT","t":8,"p":"-1","q":"0.1","T":1700000001000,"m":true}',
    ]
    cap.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    out = tmp_path / "r.json"
    assert main(["inspect", str(cap), "--tokenizer", "tiny", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert (rep["events"], rep["errors"], rep["gaps"]) == (3, 1, 1)
    assert rep["error_kinds"] == {"bad_price": 1} and "expected 6, got 7" in rep["gap_samples"][0]
    trades = rep["streams"]["BTCUSDT trade"]
    assert (trades["events"], trades["first_ts"], trades["last_ts"]) == (2, 1700000000 * S, 1700000001 * S)
    assert trades["gaps"] == 1 and rep["streams"]["BTCUSDT quote"]["gaps"] == 0
    assert [x["text"] for x in trades["lines"]] == ["2023-11-14T22:13:20 buy 100.55 0.5", "22:13:21 sell 100.6 0.1"]
    assert all(x["tokens"] > 0 for x in trades["lines"]) and trades["tokens_per_line"] > 0
    assert rep["streams"]["BTCUSDT quote"]["first_ts"] == 1000 and rep["tokens_per_line"] > 0
    assert "bad_price 1" in capsys.readouterr().out


def test_inspect_refuses_what_it_cannot_read(tmp_path: Path, capsys) -> None:
    csv = tmp_path / "x_trades.csv"
    csv.write_text("time,price,size\n11/5/2019 9:30,1,1\n")
    assert main(["inspect", str(csv), "--tokenizer", "none"]) == 2
    assert "--time-format" in capsys.readouterr().err
    assert main(["inspect", str(csv), "--tokenizer", "none", "--time-format", "%d/%m/%Y %H:%M"]) == 0
    odd = tmp_path / "x.xml"
    odd.write_text("{}")
    assert main(["inspect", str(odd), "--tokenizer", "none"]) == 2
    assert "unknown file format" in capsys.readouterr().err
    bad = tmp_path / "ethusdt_bad.gz"
    bad.write_text("not gzip\n")
    assert main(["inspect", str(bad), "--tokenizer", "none", "--market", "usdm"]) == 2
    assert "ethusdt_bad.gz: not a gzip capture" in capsys.readouterr().err


def test_inspect_bar_table_reports_missing_intervals(tmp_path: Path) -> None:
    csv = tmp_path / "es_1m.csv"
    csv.write_text("timestamp,open,high,low,close,volume\n1640991660,10,11,9,10,1\n1640991720,10,11,9,10,1\n"
                   "1640991900,10,11,9,10,1\n")  # 23:03 and 23:04 missing
    out = tmp_path / "r.json"
    assert main(["inspect", str(csv), "--tokenizer", "none", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    (stream,) = rep["streams"].values()
    assert rep["gaps"] == stream["gaps"] == 1 and rep["tokens_per_line"] is None
    assert "to 2021-12-31T23:05:00.000+00:00" in stream["gap_samples"][0]
    assert rep["first_ts"] == 1640991660 * S and rep["last_ts"] == 1640991960 * S  # first start, last end


def test_inspect_counts_records_kept_out_on_purpose(tmp_path: Path, capsys) -> None:
    """Kraken Futures block trades are not market prints: no event, no error, counted as skipped."""
    def trade(seq: int, kind: str) -> str:
        return json.dumps({"feed": "trade", "product_id": "PI_XBTUSD", "uid": f"u{seq}", "side": "buy", "type": kind,
                           "seq": seq, "time": 1626994887000 + seq, "qty": 300.0, "price": 32172.5})

    cap = tmp_path / "KRAKEN_FUTURES.ws.1.0.gz"
    lines = [f"{1000 + i} {trade(10 + i, kind)}" for i, kind in enumerate(("fill", "block", "fill", "block"))]
    cap.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    out = tmp_path / "r.json"
    assert main(["inspect", str(cap), "--tokenizer", "none", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert (rep["events"], rep["errors"], rep["gaps"], rep["skipped"]) == (2, 0, 0, {"block trade": 2})
    assert "skipped on purpose (not market events): block trade 2" in capsys.readouterr().out


def test_inspect_names_what_it_sets_aside_and_a_book_without_snapshot(tmp_path: Path, capsys) -> None:
    kline = {"e": "kline", "E": 1672515782136, "s": "BTCUSDT", "k": {
        "t": 1672515780000, "T": 1672515839999, "s": "BTCUSDT", "i": "1m", "f": 100, "L": 200, "o": "10",
        "c": "11", "h": "12", "l": "9", "v": "5", "n": 3, "x": False, "q": "50", "V": "2", "Q": "20", "B": "0"}}
    closed = json.loads(json.dumps(kline))
    closed["k"]["x"] = True
    depth = {"e": "depthUpdate", "E": 1672515782136, "s": "BTCUSDT", "U": 157, "u": 160,
             "b": [["10", "1"]], "a": [["11", "1"]]}
    msgs = [{"result": None, "id": 1}, kline, kline, closed, depth]
    cap = tmp_path / "btcusdt_k.gz"
    cap.write_bytes(gzip.compress(("\n".join(f"{1000 + i} {json.dumps(m)}" for i, m in enumerate(msgs)) + "\n").encode()))
    out = tmp_path / "r.json"
    assert main(["inspect", str(cap), "--tokenizer", "none", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["skipped"] == {"subscription reply": 1, "unclosed kline": 2} and rep["events"] == 2
    assert rep["streams"]["BTCUSDT book"]["book"] == "cannot be rebuilt: no depth snapshot"
    assert rep["notes"][0].startswith("BTCUSDT: no depth snapshot, so its order book cannot be rebuilt (1 book updates only")
    bar = rep["streams"]["BTCUSDT bar"]
    assert (bar["first_ts"], bar["last_ts"]) == (1672515780000 * 10**6, 1672515840000 * 10**6)  # start -> end
    text = capsys.readouterr().out
    assert "skipped on purpose (not market events): subscription reply 1, unclosed kline 2" in text
    assert "its order book cannot be rebuilt" in text
