"""The context sweep of `streamllm bench replay`, on recorded lines only.

One session (the config's first session: its system prompt and standing questions) is
filled with the recording's own lines to each size; the sweep stops at the first size
the recording cannot fill (it never pads with synthetic bars). Per size, `reps` times:

- **from push**: one new recorded bar is pushed and every standing question is asked
  at once for that bar's data_version; each is timed from the push (push -> ingest ->
  re-position -> answer), what a subscriber waiting for the new bar sees;
- **entries fresh**: after the engine is idle, every standing question again (the
  entries are already at the newest data: the steady state);
- one ad-hoc question on ours (cold path);
- the prefix cache on the same context (its cache holds the context up to the previous
  question: it pays one bar + question), the peer likewise, and stateless fewer times.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from bench.baselines import Peer, PrefixCache, Stateless
from bench.common import budget_for, fill_session
from bench.loadgen import AD_HOC_QUESTIONS
from streamllm.config import QueryConfig
from streamllm.engine.standing.gate import Gate

SWEEP_SERIES = ("ours_from_push", "ours", "ours_cold", "prefixcache", "stateless", "peer")


@dataclass(slots=True)
class Sweep:
    source: str = ""  # where the lines came from
    lines_available: int = 0
    ms: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # series -> size -> ms
    paths: dict[int, dict[str, int]] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)  # size -> tokens the session held
    lines_used: dict[int, int] = field(default_factory=dict)  # size -> recorded lines pushed so far
    stopped_at: int | None = None  # first size the recording could not fill
    wall_s: float = 0.0


def sweep_phase(engine, config: QueryConfig, args: argparse.Namespace, lines: list[str], source: str,
                sizes: list[int], sweep_context: int, peer: Peer | None) -> Sweep:
    spec = config.sessions[0]
    out = Sweep(source, len(lines), {s: {} for s in SWEEP_SERIES})
    engine.open_session("sweep", system=spec.system_prompt, max_context=budget_for(sweep_context, slack=16))
    for q in spec.questions:
        engine.register("sweep", q)
    gates = {q.id: Gate.for_question(q, engine.tokenizer) for q in spec.questions}
    qids = {q.id: engine.layout.question_ids(q.text) for q in spec.questions}
    prefix, stateless = PrefixCache(engine, args.chunk), Stateless(engine, args.chunk)
    feed = iter(lines)
    used = 0

    def counted():
        nonlocal used
        for line in feed:
            used += 1
            yield line

    source_lines = counted()
    t0 = time.perf_counter()
    bar = tqdm(total=len(sizes), desc="context sweep (recorded lines)", unit="size", leave=False,
               disable=args.no_progress)
    try:
        for n in sizes:
            bar.set_postfix_str(f"filling to {n} tokens")
            try:
                held = fill_session(engine, "sweep", n, source_lines)
                news = [next(source_lines) for _ in range(args.sweep_reps)]
            except StopIteration:
                out.stopped_at = n
                break
            out.held[n], out.lines_used[n] = held, used
            if engine.session_info("sweep").compactions:
                raise RuntimeError("the sweep session was compacted: its sizes would not be what they say")
            session = engine.sessions["sweep"]
            prefix.adopt("sweep", session.table, engine.call(lambda _c, s=session: s.token_ids[: s.num_computed]))
            for system in SWEEP_SERIES:
                out.ms[system][n] = []
            paths: dict[str, int] = {}
            for rep, line in enumerate(news):
                t = time.perf_counter()
                ack = engine.push("sweep", [line])
                futures = [engine.submit_ask("sweep", q.id, min_version=ack.data_version) for q in spec.questions]
                for fut in futures:
                    fut.result()
                    out.ms["ours_from_push"][n].append((time.perf_counter() - t) * 1000)
                engine.wait_idle()
                for q in spec.questions:
                    t = time.perf_counter()
                    ans = engine.ask("sweep", q.id)
                    out.ms["ours"][n].append((time.perf_counter() - t) * 1000)
                    paths[ans.path] = paths.get(ans.path, 0) + 1
                t = time.perf_counter()
                engine.ask("sweep", AD_HOC_QUESTIONS[rep % len(AD_HOC_QUESTIONS)], max_tokens=args.adhoc_tokens)
                out.ms["ours_cold"][n].append((time.perf_counter() - t) * 1000)
                ctx = engine.call(lambda _c, s=session: s.token_ids[: s.num_computed])
                for q in spec.questions:
                    out.ms["prefixcache"][n].append(
                        prefix.answer("sweep", ctx, qids[q.id], q.max_tokens, gates[q.id]).ms)
                    if peer is not None:
                        out.ms["peer"][n].append(peer.answer(ctx, qids[q.id], q.max_tokens, gates[q.id]).ms)
            out.paths[n] = paths
            reps = 0 if n > args.stateless_max else (args.stateless_reps if n <= 2048 else 1)
            q0 = spec.questions[0]
            for _ in range(reps):
                out.ms["stateless"][n].append(stateless.answer(ctx, qids[q0.id], q0.max_tokens, gates[q0.id]).ms)
            bar.update()
    finally:
        bar.close()
        prefix.close()
        engine.close_session("sweep")
    out.wall_s = time.perf_counter() - t0
    return out
