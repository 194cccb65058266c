"""`streamllm tune --questions CONFIG --data FILE... --out DIR`: teach the model a config's labelled
questions from recorded bars (streamllm/tuning/tune.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamllm.cli.common import add_read_args
from streamllm.config import ConfigError
from streamllm.model import seriesfit
from streamllm.model.words import check_words
from streamllm.tuning import tune
from streamllm.tuning.card import card_markdown
from streamllm.tuning.data import TuneError, Variant
from streamllm.tuning.from_live import export_live
from streamllm.tuning.tune import run


def _words(text: str) -> tuple[int | str, ...]:
    """--words: comma-separated distinct word indices >= 0 or prefixes ("" for none)."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    try:
        return check_words([int(w) if w.lstrip("-").isdigit() else w for w in words])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--words {text!r}: {exc} (e.g. 2, or 2,v)") from None


def _variant(text: str) -> Variant:
    try:
        return Variant.parse(text)
    except TuneError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm tune", description=tune.__doc__.split("\n")[0])
    p.add_argument("--from-live", nargs="+", type=Path, metavar="SNAPSHOT",
                   help="write the heads questions learned live (docs/calibration.md) from these session snapshots "
                        "into --out as an adapter, instead of tuning; with --changes as the sessions render")
    p.add_argument("--changes", choices=("price", "bp"), default="price",
                   help="with --from-live: the bar lines the sessions wrote ([sessions.render] changes)")
    p.add_argument("--questions", help="config with labelled questions (queries/*.toml); required unless --from-live")
    p.add_argument("--data", nargs="+",
                   help="files to train and validate on (bar or trade tables, Databento DBN, captures: read as inspect "
                        "reads them), or synthetic:SEED (feeds/synthetic.py); "
                        "PATH@FROM..TO keeps the bars opening in that range (ISO dates, UTC; either end optional)")
    p.add_argument("--mix", nargs="+", default=[], metavar="DATA",
                   help="more markets for training only, as --data (e.g. synthetic:7 synthetic:8 "
                        "sp500.csv.gz@2013-04-01..): heads that have seen other price levels and line layouts "
                        "transfer better; never judged on")
    p.add_argument("--mix-as", nargs="+", type=_variant, default=[], metavar="SPEC",
                   help="train also on --data's training range as another market shows it: price=X (X times the "
                        "price, 6 significant digits), volume=V (V times the volume: another size unit), bars=N (N "
                        "bars merged: larger moves), every=S (stamped S seconds apart), for=ID+ID (only these questions' heads "
                        "train on it); e.g. price=0.00003 price=0.003,bars=30,every=86400 volume=1000,for=volume_spike; "
                        "--mix-windows each")
    p.add_argument("--mix-windows", type=int, default=4,
                   help="training windows from each --mix source (each instrument of a synthetic market)")
    p.add_argument("--mix-dev-windows", type=int, default=0, metavar="N",
                   help="development windows from each --mix table too (never overlapping its training windows): "
                        "features, weight decay, early stopping and the gate then judge those markets as well")
    p.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    p.add_argument("--method", choices=("series", "head", "lora"), default="series",
                   help="series: a readout per question over the last lines' states (minutes on a CPU); head: over "
                        "the decision point's state; lora: peft's LoRA on the top layers")
    p.add_argument("--session", action="append", help="session of the config (repeatable; default: every session "
                                                      "with labelled questions)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="the forward's dtype for states (auto: the engine's default, so "
                                                   "heads train on the numbers they will read)")
    p.add_argument("--minutes", type=float, default=20.0, help="time budget; training windows stop when it is spent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="with --no-cache: reuse the states already extracted under OUT/states (the shared cache "
                        "makes it redundant otherwise)")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the shared state cache: this run's states go under OUT/states")
    p.add_argument("--cache-dir", type=Path, help="the state cache (default $STREAMLLM_STATES, else "
                                                  "$STREAMLLM_HOME/states; docs/tuning.md)")
    p.add_argument("--no-base-model", dest="base_model", action="store_false",
                   help="--method series: leave the base model's figures off the card, so judged windows need no "
                        "decision points: a new question over cached lines extracts nothing")
    p.add_argument("--base-model-windows", type=int, default=2, metavar="N",
                   help="--method series: the base model's figures from the first N windows of each judged source "
                        "(each runs the whole model and branches every decision point; the others stop at the tap "
                        "layer)")
    p.add_argument("--target-precision", type=float, default=0.9)
    add_read_args(p)  # --market, --columns, --time-format, --tz, --signed-prices: as every command reads files
    p.add_argument("--window", type=int, default=160, help="bars per window (one session each)")
    p.add_argument("--stride", type=int, default=2, help="a decision point every STRIDE bars")
    p.add_argument("--train-windows", type=int, default=16)
    p.add_argument("--dev-windows", type=int, default=3)
    p.add_argument("--later-windows", type=int, default=4)
    p.add_argument("--judge", nargs="*", default=[], help="other instruments, never trained on: files as --data (PATH@FROM..TO too)")
    p.add_argument("--judge-bar-seconds", type=float, help="bar interval for --judge captures (default: the session's; "
                                                           "bar tables keep their own)")
    p.add_argument("--judge-time-format", help="as --time-format, for --judge tables")
    p.add_argument("--judge-windows", type=int, default=1,
                   help="windows per --judge source, spread evenly over it (a capture is usually one)")
    p.add_argument("--synthetic-bars", type=int, default=160, help="synthetic bars per instrument (0: none)")
    p.add_argument("--judge-bars", type=int, help="bars per --judge / synthetic window (default: --window)")
    series = p.add_argument_group("--method series")
    series.add_argument("--tap-layer", type=int, default=12, help="read each line's residual stream after this layer")
    series.add_argument("--lines", type=int, default=24, help="lines a head reads (at least the labels' history)")
    series.add_argument("--series-rank", type=int, default=8, help="numbers a head takes from each line")
    series.add_argument("--fit-orders", type=int, default=3, metavar="N",
                        help="fits per candidate, each its own minibatch order: features and weight decay chosen by "
                             "the mean development loss, the head served the mean of the chosen fits (rank N x R)")
    series.add_argument("--choose", choices=("best", "simplest"), default="best",
                        help="best: the candidate of the lowest mean development loss; simplest: the fewest features "
                             "(then the most weight decay) within one standard error of it over the --fit-orders "
                             "(steadier where candidates differ by less than the orders' own spread)")
    series.add_argument("--reduce", type=int, default=seriesfit.REDUCE or 0, metavar="D",
                        help="fit a feature set wider than D through its D leading principal directions: fits a few "
                             "times faster, heads a few points less accurate on other markets (docs/tuning.md); "
                             "0, the default: every column")
    series.add_argument("--words", type=_words, default=(2, "v"), metavar="I,J",
                        help="words whose last token each line's features add: an index, or a prefix for the "
                             "line's first word that starts with it (default 2,v: a bar line's change and volume, "
                             "`23:02 46411 +34 h+5 v1.83M`); empty for [mean, last] only")
    lora = p.add_argument_group("--method lora")
    lora.add_argument("--lora-layers", type=int, default=8, help="adapt the top N layers (the rest run once per window)")
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--alpha", type=float, default=16.0)
    lora.add_argument("--lr", type=float, default=3e-4)
    lora.add_argument("--points", type=int, default=48, help="decision points per step")
    lora.add_argument("--kl", type=float, default=0.1, help="weight of the KL term to the base model")
    lora.add_argument("--eval-every", type=int, default=20, help="steps between dev evaluations (early stopping)")
    lora.add_argument("--max-steps", type=int, help="stop after this many steps even with budget left")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.from_live:
        try:
            card = export_live(args.from_live, args.out, args.changes)
        except TuneError as exc:
            print(f"streamllm tune: error: {exc}", file=sys.stderr)
            return 2
        for qid, info in card["questions"].items():
            print(f"{qid}: {info['fits']} fits on {info['samples']} samples ({info['snapshot']})")
        print(f"wrote {args.out}/head.safetensors, card.json")
        return 0
    if not args.questions or not args.data:
        p.error("--questions and --data are required (or --from-live SNAPSHOT...)")
    try:
        card = run(args)
    except (TuneError, ConfigError) as exc:
        print(f"streamllm tune: error: {exc}", file=sys.stderr)
        return 2
    print(card_markdown(card))
    made = "lora/ (peft)" if card["method"] == "lora" else "head.safetensors"
    print(f"wrote {args.out}/{made}, card.json, card.md")
    return 0
