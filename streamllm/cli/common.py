"""Flags several commands share."""

from __future__ import annotations

import argparse


def add_read_args(p: argparse.ArgumentParser) -> None:
    """--market, --columns, --time-format, --tz, --signed-prices on an argparse parser (calibrate, bench
    replay, serve, inspect, tune): every command reads recorded files alike."""
    p.add_argument("--market", default="spot", choices=("spot", "usdm", "coinm"),
                   help="Binance captures: spot, USD-M or COIN-M futures (depth gap rules differ)")
    p.add_argument("--columns", action="append", metavar="FIELD=COLUMN[,...]",
                   help="table columns for our fields, e.g. ts_event=time,close=Close,side=Side (repeatable)")
    p.add_argument("--time-format", help="strftime format of a text time column, e.g. '%%m/%%d/%%Y %%H:%%M'")
    p.add_argument("--tz", help="zone of times written without one (default UTC), e.g. America/New_York")
    p.add_argument("--signed-prices", action="store_true",
                   help="tables: read prices at or below zero (a futures contract or spread that went "
                        "negative) instead of refusing those rows")
