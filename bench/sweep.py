"""The context sweep of `streamllm bench replay`: one session filled to each size, then per
size one new bar and every standing question on ours, the prefix cache, the peer and (fewer
times) stateless. Ours should stay flat; the baselines pay for the context."""

from __future__ import annotations

import argparse
import itertools
import time

from tqdm import tqdm

from bench.baselines import Peer, PrefixCache, Stateless
from bench.common import budget_for, fill_session, market_lines
from bench.loadgen import AD_HOC_QUESTIONS
from streamllm.config import QueryConfig

SYSTEMS = ("ours", "prefixcache", "stateless", "peer")


def sweep_phase(engine, config: QueryConfig, args: argparse.Namespace, run, sizes: list[int],
                sweep_context: int, peer: Peer | None) -> None:
    spec = config.sessions[0]
    engine.open_session("sweep", system=spec.system_prompt, max_context=budget_for(sweep_context, slack=16))
    for q in spec.questions:
        engine.register("sweep", q)
    recorded = run.sink.lines.get(spec.name, []) if run.sink is not None else []
    lines = itertools.chain(recorded, market_lines(args.seed, spec.render.bar_seconds or 5, (spec.instrument,)))
    run.notes.append(f"the sweep session holds the {len(recorded)} recorded lines of session {spec.name!r}, "
                     "then synthetic bars of the embedded feed once the recording runs out")
    prefix, stateless = PrefixCache(engine, args.chunk), Stateless(engine, args.chunk)
    qids = {q.id: engine.layout.question_ids(q.text) for q in spec.questions}
    for system in SYSTEMS + ("ours_cold",):
        run.sweep[system] = {n: [] for n in sizes}
    t0 = time.perf_counter()
    bar = tqdm(total=len(sizes), desc="context sweep", unit="size", leave=False)
    try:
        for n in sizes:
            bar.set_postfix_str(f"filling to {n} tokens")
            run.sweep_held[n] = fill_session(engine, "sweep", n, lines)
            if getattr(engine.sessions["sweep"], "compactions", 0):
                raise RuntimeError("the sweep session was compacted: its sizes would not be what they say")
            session = engine.sessions["sweep"]
            # The cache starts where a prefix-caching server would already be.
            prefix.adopt("sweep", session.table, engine.call(lambda _c, s=session: s.token_ids[: s.num_computed]))
            paths: dict[str, int] = {}
            bar.set_postfix_str(f"asking at {run.sweep_held[n]} tokens")
            for rep in range(args.sweep_reps):
                engine.push("sweep", [next(lines)])  # one new bar, then the questions
                engine.wait_idle()
                for q in spec.questions:
                    t = time.perf_counter()
                    ans = engine.ask("sweep", q.id, max_tokens=q.max_tokens)
                    run.sweep["ours"][n].append((time.perf_counter() - t) * 1000)
                    paths[ans.path] = paths.get(ans.path, 0) + 1
                t = time.perf_counter()
                engine.ask("sweep", AD_HOC_QUESTIONS[rep % len(AD_HOC_QUESTIONS)], max_tokens=args.adhoc_tokens)
                run.sweep["ours_cold"][n].append((time.perf_counter() - t) * 1000)
                ctx = engine.call(lambda _c, s=session: s.token_ids[: s.num_computed])
                for q in spec.questions:
                    run.sweep["prefixcache"][n].append(prefix.answer("sweep", ctx, qids[q.id], q.max_tokens).ms)
                    if peer is not None:
                        run.sweep["peer"][n].append(peer.answer(ctx, qids[q.id], q.max_tokens).ms)
            run.sweep_paths[n] = paths
            reps = 0 if n > args.stateless_max else (args.stateless_reps if n <= 2048 else 1)
            run.stateless_reps[n] = reps
            q0 = spec.questions[0]
            for _ in range(reps):
                run.sweep["stateless"][n].append(stateless.answer(ctx, qids[q0.id], q0.max_tokens).ms)
            bar.update()
    finally:
        bar.close()
        prefix.close()
        engine.close_session("sweep")
    run.sweep_wall_s = time.perf_counter() - t0
