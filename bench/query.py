"""`streamllm bench query`: what a question costs on a stateful session, vs recomputing the context.

In one run, on one model and machine:
  ask_ms_p50@N        a one-token ad-hoc question on a session already holding N tokens (ours)
  stateless_ms_p50@N  the same answer the stateless way: prefill system + data + question
                      from scratch on the same runner (chunked like a serving engine would)
  speedup@N           stateless / ask
  prefill_tok_s, decode_ms          our forward
  hf_prefill_tok_s, hf_decode_ms    transformers' forward with its DynamicCache, same weights
  kv_bytes_per_token
With --peer-url (an OpenAI-compatible server on the same GGUF, e.g. `make peer`'s llama-server),
the peer answers the same ids as text, asked in turn with ours, rep by rep:
  peer_ask_ms_p50@N   the same question on the same N-token context, held in its prompt cache
                      (before each ask it is sent the context alone, so the question is computed
                      anew each time, as ours is); peer_prompt_tokens@N: what it computed
  ask_vs_peer@N       peer / ours (> 1: ours is faster)
  engine_decode_ms, peer_decode_ms   per generated token, through each server's own ask path:
                      (an answer of up to --decode-steps + 1 tokens - a one-token answer) / extra
                      tokens, greedy, on the smallest context; peer_decode_ms_reported: its timings
The questions run in --dtype (default auto); then fp32 and bf16 side by side (bench/dtype.py):
  prefill_tok_s_fp32/_bf16          512 tokens into fresh cells
  decode_ms_fp32/_bf16              one token on a session of --update-context tokens
  decode_ms_bf16_only               the same with bf16 weights only (no fp32 or 4-bit copies, no native step)
  prepos_update_ms_fp32/_bf16       one bar pushed + 4 standing questions re-positioned, one session
  updates_per_s_fp32/_bf16          1000 / prepos_update_ms
  max_abs_logit_diff_bf16, max_gap_diff_bf16, gate_decisions, gate_changes_bf16, gate_flips_bf16
                                    bf16 vs fp32 at the shipped questions' decision points
  *_ratio_bf16                      prefill bf16/fp32; decode and update fp32/bf16 (> 1: bf16 faster)
"""

from __future__ import annotations

import argparse

import torch

from bench import dtype as dt
from bench.baselines import Peer
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
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.kv import BlockTable
from streamllm.engine.runner import Work
from streamllm.model import load_model

QUESTION = "Is the price going up or down? Answer with one word."
LONG_QUESTION = "Describe the last five bars in words, one sentence for each bar."


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
    engine = Engine(loaded, EngineConfig(max_cells=max_context * 2 + 4096, max_context=max_context, scheduler=SchedulerConfig(chunk_tokens=args.chunk, step_tokens=args.chunk)), device=args.device, dtype=args.dtype)
    print(f"engine dtype: {engine.model.dtype_choice.reason}", flush=True)
    metrics: dict[str, float] = {}
    rows, peer_rows = [], []
    peer = Peer(args.peer_url, loaded.tokenizer) if args.peer_url else None
    try:
        lines = market_lines()
        engine.open_session("bench")
        q_ids = engine.layout.question_ids(QUESTION)
        for n in contexts:
            held = fill_session(engine, "bench", n, lines)
            print(f"context {held} tokens: asking {args.reps}x, stateless {args.stateless_reps}x ...", flush=True)
            session = engine.sessions["bench"]
            context_ids = session.token_ids[: session.num_computed]
            ask, peer_ms, peer_tokens = [], [], []
            if peer is not None:
                if n == contexts[0] and peer.tokens_match(context_ids) is False:
                    print("note: the peer tokenizes the prompt text differently from our ids", flush=True)
                peer.complete(peer.prompt(context_ids, []), 1)  # its prefill, as fill_session was ours
            for _ in range(args.reps + 1):  # the first round warms up
                ask.append(engine.ask("bench", QUESTION, max_tokens=1).latency_ms)
                if peer is not None:
                    ms, reply = peer_ask(peer, context_ids, q_ids, 1)
                    peer_ms.append(ms)
                    peer_tokens.append(computed_tokens(reply))
            ask = ask[1:]
            ids = context_ids + q_ids
            stateless = [stateless_ms(engine, ids, args.chunk) for _ in range(args.stateless_reps)]
            metrics[f"ask_ms_p50@{n}"] = median(ask)
            metrics[f"stateless_ms_p50@{n}"] = median(stateless)
            metrics[f"speedup@{n}"] = median(stateless) / median(ask)
            metrics[f"context_tokens@{n}"] = held
            rows.append([n, held, median(ask), median(stateless), metrics[f"speedup@{n}"]])
            if peer is not None:
                metrics[f"peer_ask_ms_p50@{n}"] = median(peer_ms[1:])
                metrics[f"peer_prompt_tokens@{n}"] = median(peer_tokens[1:])
                metrics[f"ask_vs_peer@{n}"] = metrics[f"peer_ask_ms_p50@{n}"] / metrics[f"ask_ms_p50@{n}"]
                peer_rows.append([n, held, len(q_ids), metrics[f"peer_prompt_tokens@{n}"], metrics[f"ask_ms_p50@{n}"],
                                  metrics[f"peer_ask_ms_p50@{n}"], metrics[f"ask_vs_peer@{n}"]])
            if n == contexts[0] and peer is not None:
                metrics.update(decode_side_by_side(engine, peer, context_ids, args))
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
    if peer is not None:
        print_table(f"ours vs the peer at {args.peer_url}, asked in turn",
                    ["N", "held", "question tokens", "peer computed", "ours ask ms", "peer ask ms", "peer/ours"], peer_rows)
        print_table(f"decode per token through each ask path ({contexts[0]}-token context, greedy)",
                    ["", "ours", "peer", "peer/ours"],
                    [["ms/token", metrics["engine_decode_ms"], metrics["peer_decode_ms"],
                      metrics["peer_decode_ms"] / metrics["engine_decode_ms"]]])
        print(f"(peer's own timings: {metrics['peer_decode_ms_reported']:.1f} ms/token; "
              f"our forward alone: {metrics['decode_ms']:.1f} ms/token)")
    if args.compare_dtypes:
        del engine
        metrics.update(compare_dtypes(loaded, args))
    return metrics


def peer_ask(peer: Peer, context_ids: list[int], question_ids: list[int], max_tokens: int) -> tuple[float, dict]:
    """The peer's answer to the question on a context it holds: (wall ms, its reply).

    It is first sent the context alone (one token), so its cache ends at the context and the
    question is computed anew, as an ad-hoc question is on ours."""
    peer.complete(peer.prompt(context_ids, []), 1)
    return peer.complete(peer.prompt(context_ids, question_ids), max_tokens)


def computed_tokens(reply: dict) -> int:
    """The prompt tokens a peer's reply says it computed (did not find cached)."""
    timings, usage = reply.get("timings") or {}, reply.get("usage") or {}
    if "prompt_n" in timings:  # llama-server
        return int(timings["prompt_n"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0  # vLLM, OpenAI
    return int(usage.get("prompt_tokens", 0)) - int(cached)


def decode_side_by_side(engine: Engine, peer: Peer, context_ids: list[int], args) -> dict[str, float]:
    """ms per generated token through each system's ask path, greedy, turn by turn: a long answer's
    time less a one-token answer's, over the extra tokens (so the question's own prefill cancels)."""
    q_ids = engine.layout.question_ids(LONG_QUESTION)
    longest = args.decode_steps + 1
    ours, theirs, reported = [], [], []
    for rep in range(4):  # the first round warms up
        short = engine.ask("bench", LONG_QUESTION, max_tokens=1).latency_ms
        answer = engine.ask("bench", LONG_QUESTION, max_tokens=longest)
        peer_short, _ = peer_ask(peer, context_ids, q_ids, 1)
        peer_long, reply = peer_ask(peer, context_ids, q_ids, longest)
        generated = int((reply.get("usage") or {}).get("completion_tokens", 0))
        if rep and len(answer.tokens) > 1 and generated > 1:
            ours.append((answer.latency_ms - short) / (len(answer.tokens) - 1))
            theirs.append((peer_long - peer_short) / (generated - 1))
            reported.append(float((reply.get("timings") or {}).get("predicted_per_token_ms", float("nan"))))
    if not ours:
        raise RuntimeError("the decode comparison got one-token answers only: no per-token time to take")
    return {"engine_decode_ms": median(ours), "peer_decode_ms": median(theirs),
            "peer_decode_ms_reported": median(reported), "decode_vs_peer": median(theirs) / median(ours)}


def compare_dtypes(loaded, args: argparse.Namespace) -> dict[str, float]:
    """fp32 and bf16 side by side on the runner, interleaved rep by rep (bench/dtype.py)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cells = args.update_context + 64 * (args.dtype_reps + 2) + 4096
    rigs = {"fp32": dt.make_rig(loaded, "float32", cells, device), "bf16": dt.make_rig(loaded, "bfloat16", cells, device)}
    bf16 = rigs["bf16"].model
    print(f"bf16 vs fp32 on {device}: few-row steps use fp32 copies {bf16.fp32_rows}, "
          f"4-bit copies {bf16.int4_rows}", flush=True)
    lines = dt.synthetic_lines(args.seed, 4096)
    layout = rigs["fp32"].layout
    prompt = dt.session_ids(layout, "", lines)[: args.prefill_tokens]
    context, i = layout.prefix_ids("You watch bars. Answer with one word."), 0
    per_line = layout.lines_ids(lines[:1024])
    while len(context) < args.update_context:
        context += per_line[i]
        i += 1
    questions = [layout.question_ids(c.spec.text) for c in dt.shipped_gate_cases()[:4]]
    tables = {name: rig.table(context) for name, rig in rigs.items()}
    times: dict[str, list[float]] = {}
    only = dict.fromkeys(bf16.fp32_rows, 0)
    for rep in range(args.dtype_reps + 1):  # rep 0 warms up
        for name, rig in rigs.items():
            got = {"prefill": dt.prefill_ms(rig, prompt), "decode": dt.decode_ms(rig, tables[name], prompt[rep]),
                   "update": dt.update_ms(rig, tables[name], lines[i + rep], questions)}
            if name == "bf16":  # the bf16 weights alone: no fp32 or 4-bit copies, no native step (it reads them)
                rows, rig.model.fp32_rows = rig.model.fp32_rows, only
                rows4, rig.model.int4_rows = rig.model.int4_rows, only
                step, rig.model._decode_step = rig.model._decode_step, None
                got["decode_only"] = dt.decode_ms(rig, tables[name], prompt[rep])
                rig.model.fp32_rows, rig.model.int4_rows, rig.model._decode_step = rows, rows4, step
            for key, value in got.items():
                if rep:
                    times.setdefault(f"{key}_{name}", []).append(value)
    m = {key: median(v) for key, v in times.items()}
    out = {
        "prefill_tok_s_fp32": len(prompt) / m["prefill_fp32"] * 1000,
        "prefill_tok_s_bf16": len(prompt) / m["prefill_bf16"] * 1000,
        "decode_ms_fp32": m["decode_fp32"], "decode_ms_bf16": m["decode_bf16"],
        "decode_ms_bf16_only": m["decode_only_bf16"],
        "prepos_update_ms_fp32": m["update_fp32"], "prepos_update_ms_bf16": m["update_bf16"],
        "update_context_tokens": float(len(context)),
    }
    out["prefill_ratio_bf16"] = out["prefill_tok_s_bf16"] / out["prefill_tok_s_fp32"]
    out["decode_ratio_bf16"] = out["decode_ms_fp32"] / out["decode_ms_bf16"]
    out["prepos_update_ratio_bf16"] = out["prepos_update_ms_fp32"] / out["prepos_update_ms_bf16"]
    out["updates_per_s_fp32"] = 1000 / out["prepos_update_ms_fp32"]
    out["updates_per_s_bf16"] = 1000 / out["prepos_update_ms_bf16"]
    for name, rig in rigs.items():
        rig.free(tables[name])
    print_table(f"bf16 vs fp32 ({device}, {len(context)}-token session, medians of {args.dtype_reps})",
                ["", "fp32", "bf16", "ratio"],
                [["prefill tok/s", out["prefill_tok_s_fp32"], out["prefill_tok_s_bf16"], out["prefill_ratio_bf16"]],
                 ["decode ms", out["decode_ms_fp32"], out["decode_ms_bf16"], out["decode_ratio_bf16"]],
                 ["decode ms, bf16 weights only", out["decode_ms_fp32"], out["decode_ms_bf16_only"],
                  out["decode_ms_fp32"] / out["decode_ms_bf16_only"]],
                 ["update ms (1 bar + 4 questions)", out["prepos_update_ms_fp32"], out["prepos_update_ms_bf16"],
                  out["prepos_update_ratio_bf16"]],
                 ["updates/s", out["updates_per_s_fp32"], out["updates_per_s_bf16"],
                  out["updates_per_s_bf16"] / out["updates_per_s_fp32"]]])
    print("gate decisions, bf16 vs fp32 ...", flush=True)
    line_sets = [dt.synthetic_lines(seed, max(args.gate_checkpoints)) for seed in range(1, args.gate_seeds + 1)]
    parity = dt.gate_parity(rigs["fp32"], rigs["bf16"], loaded.tokenizer, line_sets, args.gate_checkpoints)
    out.update(max_abs_logit_diff_bf16=parity.max_abs_logit_diff, max_gap_diff_bf16=parity.max_gap_diff,
               gate_decisions=float(parity.decisions), gate_changes_bf16=float(parity.changed),
               gate_flips_bf16=float(parity.flips), top1_changes_bf16=float(parity.top1_changed))
    print(f"gate: {parity.decisions} decisions, {parity.changed} changed, {parity.flips} flipped with a clear fp32 "
          f"margin (>= {dt.CLEAR_MARGIN}); max |logit diff| {parity.max_abs_logit_diff:.3f}, "
          f"max |gap diff| {parity.max_gap_diff:.3f}")
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamllm bench query", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="the engine's dtype")
    p.add_argument("--quick", action="store_true", help="fewer contexts and repetitions: a few minutes on a CPU")
    p.add_argument("--contexts", default="512,2048,4096", help="comma-separated context sizes in tokens")
    p.add_argument("--reps", type=int, default=10, help="asks per context")
    p.add_argument("--stateless-reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--compare-dtypes", action=argparse.BooleanOptionalAction, default=True,
                   help="also run fp32 and bf16 side by side (speed and gate decisions)")
    p.add_argument("--update-context", type=int, default=2048, help="session tokens for decode and update")
    p.add_argument("--dtype-reps", type=int, default=7)
    p.add_argument("--gate-seeds", type=int, default=2, help="synthetic contexts for the gate comparison")
    p.add_argument("--gate-checkpoints", default="16,64", help="bar lines at which every question is asked")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--peer-url", help="an OpenAI-compatible server on the same model, asked beside ours "
                                      "(make peer: http://127.0.0.1:8080)")
    p.add_argument("--json", help="write the metrics here")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.reps, args.stateless_reps, args.decode_steps = "512,2048", 5, 1, 8
        args.dtype_reps, args.gate_seeds, args.gate_checkpoints = 5, 1, "16,40"
    args.gate_checkpoints = parse_ints(args.gate_checkpoints)
    metrics = run(args)
    write_json(args.json, metrics, {"bench": "query", "model": args.model, "dtype": args.dtype,
                                    "quick": args.quick})
    return 0
