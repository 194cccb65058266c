"""`streamllm demo`: the whole loop on the embedded default (streamllm/demo.py)."""

from __future__ import annotations

import argparse
import sys

from streamllm import demo
from streamllm.demo import DEFAULT_CONFIG


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm demo", description=demo.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="standing-question config (TOML)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds to run")
    p.add_argument("--speed", type=float, default=2.5, help="simulated market seconds per wall second")
    p.add_argument("--ask-every", type=float, default=6.0, help="seconds between demo questions")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bf16 where the CPU runs bf16 products fast (AMX/AVX512-BF16) and on CUDA")
    p.add_argument("--adapter", help="choice heads from `streamllm tune` (default: the config's [model] adapter)")
    p.add_argument("--live", action=argparse.BooleanOptionalAction, default=sys.stdout.isatty(),
                   help="live table (default on a terminal) or one line per change")
    return demo.run(p.parse_args(argv))
