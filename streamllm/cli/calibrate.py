"""`streamllm calibrate --questions CONFIG [--data FILE]`: replay recorded data and calibrate the gate
thresholds of a config's labelled questions (streamllm/evaluation/calibrate.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from streamllm.cli.common import add_read_args
from streamllm.config import ConfigError
from streamllm.engine.standing.gate import GateError
from streamllm.evaluation import calibrate as calibrate_lib
from streamllm.evaluation.calibrate import DEFAULT_BARS, CalibrationError, calibrate
from streamllm.evaluation.report import plot, table, to_json
from streamllm.evaluation.samples import write_samples
from streamllm.tuning.card import fmt_number


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm calibrate", description=calibrate_lib.__doc__.split("\n")[0])
    p.add_argument("--questions", required=True, help="config with labelled questions (queries/*.toml)")
    p.add_argument("--data", help="bars or trades: a table, Databento DBN or capture (default: the session's csv: "
                                  "feed); PATH@FROM..TO replays the bars opening in that range (ISO dates, UTC)")
    p.add_argument("--target-precision", type=float, default=0.9)
    p.add_argument("--auto-confidence", type=float, metavar="C",
                   help="replay the live auto gate judging its precision by a lower bound at one-sided confidence C "
                        "(0.5 <= C < 1; 0.5: the point estimate; default: each question's own auto_confidence)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="write the risk-coverage plot here (PNG)")
    p.add_argument("--samples", type=Path, metavar="FILE",
                   help="write every sample here (question, range, bar, gap, answer, truth, correct, live_fired): "
                        "CSV, or Parquet for a .parquet name")
    p.add_argument("--from-samples", type=Path, metavar="FILE",
                   help="judge the samples a replay wrote with --samples (CSV or Parquet) instead of replaying: "
                        "another --target-precision or --auto-confidence in seconds, no model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bars", type=int, help=f"bars to replay, warmup included (default {DEFAULT_BARS}, "
                                             "fewer when the session's context cannot hold them)")
    p.add_argument("--session", help="session of the config (default: the first with labelled questions)")
    p.add_argument("--warmup", type=int, help="bars pushed as one batch before recording "
                                              "(default: the longest label history minus one)")
    p.add_argument("--start", type=int, nargs="+", default=[0],
                   help="skip this many bars of the file first (judge on later data); several: each range replayed "
                        "in a fresh session (--bars each), their samples pooled: one threshold, intervals per range")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--adapter", help="choice heads from `streamllm tune`: the gate decides from them (default: "
                                         "the config's [model] adapter when it was trained on --model)")
    heads.add_argument("--no-adapter", action="store_true", help="judge the untuned model, whatever the config says")
    p.add_argument("--no-progress", action="store_true")
    add_read_args(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        run, reports, meta = calibrate(args)
    except (CalibrationError, ConfigError, GateError) as exc:
        print(f"streamllm calibrate: error: {exc}", file=sys.stderr)
        return 2
    ranges = f" in {len(meta['start'])} ranges pooled" if isinstance(meta["start"], list) else ""
    if args.from_samples is not None:
        print(f"\n{sum(len(r.gaps) for r in run.records)} samples on {run.updates} bars{ranges} from "
              f"{args.from_samples} (no replay), target precision {args.target_precision:g}")
    else:
        print(f"\n{run.updates} updates on {run.bars} bars ({run.warmup} warmup){ranges} in {run.seconds:.0f}s, "
              f"model {run.model}, target precision {args.target_precision:g}")
    print(table(reports, args.target_precision))
    scored = [r for r in reports if r.samples]
    if scored and "without_head" in meta:  # a replay knows its heads; a samples file does not
        weakest = min(scored, key=lambda r: r.coverage if r.coverage is not None else -1.0)
        headless = [q for q in meta.get("without_head", []) if any(r.id == q for r in scored)]
        who = ("; every question decided by the model's own logits (no choice heads)" if meta.get("adapter") is None
               else f"; it counts {len(headless)} without a choice head (the model's logits decide them): "
                    f"{', '.join(headless)}" if headless else "; every question has a choice head")
        print(f"config-wide minimum coverage at {args.target_precision:g}: {fmt_number(weakest.coverage)} "
              f"({weakest.id}) over {len(scored)} questions{who}")
    if meta.get("left_out_no_label"):
        print(f"left out, having no label: {', '.join(meta['left_out_no_label'])}")
    if meta.get("left_out_no_volume"):
        print(f"left out, their labels reading volume the bars do not have: {', '.join(meta['left_out_no_volume'])}")
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(run, reports, meta), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.samples is not None:
        rows = write_samples(run.records, reports, args.samples)
        print(f"wrote {args.samples} ({rows} samples)")
    if args.plot is not None:
        plot(reports, args.target_precision, args.plot,
             f"{run.session}: {run.model}, {run.updates} updates")
        print(f"wrote {args.plot}")
    return 0
