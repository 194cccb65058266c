"""`streamllm inspect FILE...`: what a capture, table or DBN file holds (streamllm/evaluation/inspect.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from feeds.sources import read_options
from streamllm.cli.common import add_read_args
from streamllm.evaluation import inspect as inspect_files
from streamllm.evaluation.inspect import count_tokens, inspect_file, mean_of, print_report
from streamllm.model import load_tokenizer


def _tokenizer(spec: str) -> Any:
    if spec == "none":
        return None
    try:
        return load_tokenizer(spec)
    except Exception as exc:  # the default tokenizer needs the converted model
        print(f"inspect: no tokenizer {spec!r} ({type(exc).__name__}: {exc}); token counts skipped", file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm inspect", description=inspect_files.__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=inspect_files.__doc__)
    p.add_argument("files", nargs="+", help="captures (.gz), DBN (.dbn, .dbn.zst), tables (.csv, .parquet)")
    add_read_args(p)
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer for token counts (tiny, none, ...)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    reports = []
    try:
        opts = read_options(args)
        for name in args.files:
            reports.append(inspect_file(name, opts))
    except (ValueError, FileNotFoundError) as exc:
        print(f"streamllm inspect: error: {exc}", file=sys.stderr)
        return 2
    count_tokens(reports, _tokenizer(args.tokenizer))
    for rep in reports:
        print_report(rep)
    if args.json is not None:
        out: dict[str, Any] = reports[0] if len(reports) == 1 else {
            "events": sum(r["events"] for r in reports), "errors": sum(r["errors"] for r in reports),
            "gaps": sum(r["gaps"] for r in reports),
            "first_ts": min((r["first_ts"] for r in reports if r["first_ts"] is not None), default=None),
            "last_ts": max((r["last_ts"] for r in reports if r["last_ts"] is not None), default=None),
            "tokens_per_line": mean_of([r["tokens_per_line"] for r in reports]),
            "streams": {f"{r['file']}: {k}": v for r in reports for k, v in r["streams"].items()},
            "files": reports}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    unreadable = [r["file"] for r in reports if r["events"] == 0 and r["errors"]]
    if unreadable:
        print(f"streamllm inspect: no events could be read from {', '.join(unreadable)}", file=sys.stderr)
        return 1
    return 0
