"""`streamllm bench query`: what a question costs on a stateful session, vs recomputing the context.

In one run, on one model and machine:
  ask_ms_p50@N        a one-token ad-hoc question on a session already holding N tokens (ours)
  stateless_ms_p50@N  the same answer the stateless way: prefill system + data + question
                      from scratch on the same runner (chunked like a serving engine would)
  speedup@N           stateless / ask
  prefill_tok_s, decode_ms          our forward
  hf_prefill_tok_s, hf_decode_ms    transformers' forward with its DynamicCache, same weights
  kv_bytes_per_token
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    budget_for,
    fill_session,
    market_lines,
    median,
    parse_ints,
    print_table,
    timed_ms,
    write_json,
)
from streamllm.engine import Engine
from streamllm.engine.kv import BlockTable
from streamllm.engine.runner import Work
from streamllm.model import load_model

QUESTION = "Is the price going up or down? Answer with one word."


def stateless_ms(engine: Engine, ids: list[int], chunk: int) -> float:
    """Prefill all of `ids` into fresh cells and produce the next-token logits."""
    return engine.call(lambda core: _stateless_ms(core, ids, chunk))  # the core owns the pool


def _stateless_ms(core, ids: list[int], chunk: int) -> float:
    manager, runner = core.store.manager, core.runner
    table = BlockTable()
    try:
        manager.append(table, len(ids))
        return timed_ms(lambda: _prefill(runner, table, ids, chunk), reps=1, warmup=0)[0]
    finally:
        manager.free(table)


def _prefill(runner, table: BlockTable, ids: list[int], chunk: int) -> torch.Tensor:
    out = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        want = "last" if start + chunk >= len(ids) else "none"
        (out,) = runner.execute([Work(table, piece, start, want)])
    return out


def our_prefill_and_decode(engine: Engine, prompt: list[int], steps: int) -> tuple[float, float]:
    return engine.call(lambda core: _our_prefill_and_decode(core, prompt, steps))  # the core owns the pool


def _our_prefill_and_decode(core, prompt: list[int], steps: int) -> tuple[float, float]:
    manager, runner = core.store.manager, core.runner
    table = BlockTable()
    manager.append(table, len(prompt) + steps + 1)
    try:
        table_len = table.num_tokens
        prefill = median(timed_ms(lambda: runner.execute([Work(table, prompt, 0, "last")]), reps=3))
        decode = []
        for i in range(steps):
            pos = len(prompt) + i
            token = prompt[i % len(prompt)]
            decode += timed_ms(lambda pos=pos, token=token: runner.execute([Work(table, [token], pos, "last")]),
                               reps=1, warmup=0)
        assert table.num_tokens == table_len
    finally:
        manager.free(table)
    return len(prompt) / (prefill / 1000), median(decode)


def hf_prefill_and_decode(loaded, prompt: list[int], steps: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    hf.eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        prefill = median(timed_ms(lambda: hf(ids, use_cache=False), reps=3))
        cache = DynamicCache(config=hf.config)
        hf(ids, cache=cache, use_cache=True)
        decode = []
        for i in range(steps):
            tok = torch.tensor([[prompt[i % len(prompt)]]])
            decode += timed_ms(lambda tok=tok: hf(tok, cache=cache, use_cache=True), reps=1, warmup=0)
    return len(prompt) / (prefill / 1000), median(decode)


def run(args: argparse.Namespace) -> dict[str, float]:
    contexts = parse_ints(args.contexts)
    loaded = load_model(args.model)
    max_context = budget_for(max(contexts))
    engine = Engine(loaded, max_cells=max_context * 2 + 4096, max_context=max_context, chunk_tokens=args.chunk,
                    step_tokens=args.chunk)
    metrics: dict[str, float] = {}
    rows = []
    try:
        lines = market_lines()
        engine.open_session("bench")
        q_ids = engine.layout.question_ids(QUESTION)
        for n in contexts:
            held = fill_session(engine, "bench", n, lines)
            print(f"context {held} tokens: asking {args.reps}x, stateless {args.stateless_reps}x ...", flush=True)
            ask = [engine.ask("bench", QUESTION, max_tokens=1).latency_ms for _ in range(args.reps + 1)][1:]
            session = engine.sessions["bench"]
            ids = session.token_ids[: session.num_computed] + q_ids
            stateless = [stateless_ms(engine, ids, args.chunk) for _ in range(args.stateless_reps)]
            metrics[f"ask_ms_p50@{n}"] = median(ask)
            metrics[f"stateless_ms_p50@{n}"] = median(stateless)
            metrics[f"speedup@{n}"] = median(stateless) / median(ask)
            metrics[f"context_tokens@{n}"] = held
            rows.append([n, held, median(ask), median(stateless), metrics[f"speedup@{n}"]])
        print("prefill and decode, ours vs transformers ...", flush=True)
        prompt = engine.sessions["bench"].token_ids[: args.prefill_tokens]
        ours_pf, ours_dec = our_prefill_and_decode(engine, prompt, args.decode_steps)
        hf_pf, hf_dec = hf_prefill_and_decode(loaded, prompt, args.decode_steps)
        metrics.update(prefill_tok_s=ours_pf, decode_ms=ours_dec, hf_prefill_tok_s=hf_pf, hf_decode_ms=hf_dec,
                       prefill_ratio=ours_pf / hf_pf, decode_ratio=hf_dec / ours_dec,
                       kv_bytes_per_token=float(engine.store.pool.bytes_per_token))
        if len(contexts) > 1:
            metrics[f"ask_ratio@{contexts[-1]}/{contexts[0]}"] = (
                metrics[f"ask_ms_p50@{contexts[-1]}"] / metrics[f"ask_ms_p50@{contexts[0]}"])
    finally:
        engine.shutdown()
    print_table(f"bench query: {args.model}, question of {len(q_ids)} tokens",
                ["N", "held", "ask_ms_p50", "stateless_ms_p50", "speedup"], rows)
    print_table(f"forward at {args.prefill_tokens} tokens", ["", "ours", "transformers", "ours/hf"],
                [["prefill tok/s", ours_pf, hf_pf, ours_pf / hf_pf], ["decode ms", ours_dec, hf_dec, hf_dec / ours_dec]])
    print(f"kv bytes per token: {engine.store.pool.bytes_per_token}")
    return metrics


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench query", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="512,2048,4096", help="comma-separated context sizes in tokens")
    p.add_argument("--reps", type=int, default=10, help="asks per context")
    p.add_argument("--stateless-reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--json", help="write the metrics here")
    args = p.parse_args(argv)
    metrics = run(args)
    write_json(args.json, metrics, {"bench": "query", "model": args.model})
    return 0
