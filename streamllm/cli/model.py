"""`streamllm model fetch|info SPEC`: fetch or convert a model into the cache, and describe one."""

from __future__ import annotations

import argparse
import sys
import time

from streamllm.model.checkpoint import DEFAULT_SPEC, VALID_FORMS, ModelError
from streamllm.model.loader import ensure_cached, load_model, parameter_count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="streamllm model", description="fetch, convert and inspect models"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser(
        "fetch", help="download/convert a model into the cache and time a load"
    )
    fetch.add_argument("spec", nargs="?", default=DEFAULT_SPEC, help=VALID_FORMS)
    info = commands.add_parser("info", help="architecture, sizes and source of a model")
    info.add_argument("spec", help=VALID_FORMS)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            start = time.perf_counter()
            cache_dir = ensure_cached(args.spec)
            if cache_dir is not None:
                print(f"cache: {cache_dir} (ready in {time.perf_counter() - start:.2f}s)")
            start = time.perf_counter()
            loaded = load_model(args.spec, progress=False)
            print(f"load:  {time.perf_counter() - start:.2f}s ({loaded.source})")
            return 0
        loaded = load_model(args.spec)
        c = loaded.config
        arch = ", ".join(getattr(c, "architectures", None) or []) or c.model_type
        tied = " (tied embeddings)" if getattr(c, "tie_word_embeddings", False) else ""
        print(f"name:       {loaded.name}")
        print(f"arch:       {arch} (model_type {c.model_type})")
        print(f"layers:     {c.num_hidden_layers}")
        print(
            f"heads:      {c.num_attention_heads} query, {c.num_key_value_heads} kv, head_dim {getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads}"
        )
        print(f"hidden:     {c.hidden_size} (mlp {c.intermediate_size})")
        print(f"vocab:      {c.vocab_size} (tokenizer {len(loaded.tokenizer)})")
        print(f"params:     {parameter_count(loaded):,}{tied}")
        print(f"source:     {loaded.source}")
        return 0
    except ModelError as exc:
        print(f"streamllm model: {exc}", file=sys.stderr)
        return 1
