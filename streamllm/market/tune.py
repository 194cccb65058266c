"""`streamllm tune`: teach the session model a config's labelled questions from recorded bars.

`--method head` (the default, and the one for CPUs) learns one choice head per
labelled question: a readout W h + b over the final normed hidden state h at the
question's decision point, the LM head's rows for its choices re-trained. States
come from the engine's own prompt layout, model, runner and KV store
(streamllm/market/extract.py); the fit is convex (streamllm/market/headfit.py).

Time split, per data file (no window straddles a boundary):

    bars: |------------- train (70%) -------------|-- dev (10%) --|---- later (20%) ----|
           fit the heads                            L2, threshold    judged only

Judged as well on other instruments (`--judge` files: Binance captures or bar tables,
rendered into bars as the configs do) and on synthetic regimes (feeds/synthetic.py).
Every extracted window is checkpointed under OUT/states; `--resume` reuses them.
Writes OUT/head.safetensors (KBs), OUT/card.json and OUT/card.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamllm.config import ConfigError, QuestionSpec, SessionSpec, load_config, normalize_question

SPLIT = (0.7, 0.8)  # train | dev | later, as fractions of each data file's bars


class TuneError(ValueError):
    """Arguments, config or data that a tuning run cannot start from."""


@dataclass(frozen=True, slots=True)
class WindowPlan:
    set: str  # train | dev | later | other | synthetic
    source: str  # data file name, or "synthetic:SYMBOL"
    start: int
    bars: int

    @property
    def key(self) -> str:
        stem = self.source.replace("/", "_").replace(":", "_")
        return f"{self.set}-{stem}-{self.start}-{self.bars}"


# -- data -----------------------------------------------------------------------------


def _columns(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise TuneError(f"--columns {pair!r}: write FIELD=COLUMN, e.g. ts_event=time")
        out[field] = column
    return out


def load_bars(paths: list[str], *, instrument: str | None, bar_seconds: float,
              columns: dict[str, str]) -> dict[str, list[Any]]:
    """Bars per source: a bar table is one source; Binance captures become bars per symbol."""
    from feeds.bars import bars as to_bars
    from feeds.events import Trade
    from feeds.sources import CaptureSource, TableSource

    out: dict[str, list[Any]] = {}
    trades: dict[str, list[Any]] = {}
    for name in sorted(paths):
        path = Path(name)
        if not path.is_file():
            raise TuneError(f"data file {path} does not exist")
        try:
            if path.name.endswith(".gz"):
                for ev in CaptureSource(path):
                    if isinstance(ev, Trade):
                        trades.setdefault(ev.instrument, []).append(ev)
            else:
                kw = {"instrument": instrument} if instrument else {}
                out[path.name] = TableSource(path, "bar", columns=columns, bar_interval_s=bar_seconds, **kw).events()
        except (OSError, ValueError, KeyError) as exc:
            raise TuneError(f"cannot read bars from {path}: {exc}") from exc
    for symbol, events in trades.items():
        events.sort(key=lambda t: t.ts_event)
        out[f"capture:{symbol}"] = list(to_bars(events, bar_seconds))
    return out


def synthetic_bars(seed: int, bars_each: int, bar_seconds: float) -> dict[str, list[Any]]:
    from feeds.bars import bars as to_bars
    from feeds.events import Trade
    from feeds.synthetic import SyntheticFeed

    events = [e for e in SyntheticFeed(seed=seed).events(bars_each * bar_seconds) if isinstance(e, Trade)]
    out: dict[str, list[Any]] = {}
    for bar in to_bars(events, bar_seconds):
        out.setdefault(f"synthetic:{bar.instrument}", []).append(bar)
    return out


def plan_windows(name: str, n_bars: int, window: int, counts: dict[str, int], rng: random.Random) -> list[WindowPlan]:
    """Non-overlapping windows inside each time range of one source."""
    plans = []
    bounds = {"train": (0, SPLIT[0]), "dev": (SPLIT[0], SPLIT[1]), "later": (SPLIT[1], 1.0)}
    for set_name, count in counts.items():
        lo, hi = (int(f * n_bars) for f in bounds[set_name])
        slots = (hi - lo) // window
        if slots <= 0 or count <= 0:
            continue
        for slot in sorted(rng.sample(range(slots), min(count, slots))):
            plans.append(WindowPlan(set_name, name, lo + slot * window, window))
    return plans


# -- the run ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamllm tune", description=__doc__.split("\n")[0])
    p.add_argument("--questions", required=True, help="config with labelled questions (queries/*.toml)")
    p.add_argument("--data", nargs="+", required=True,
                   help="bar tables (CSV/Parquet) to train and validate on, or synthetic:SEED (feeds/synthetic.py)")
    p.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    p.add_argument("--method", choices=("head", "lora"), default="head",
                   help="head: a readout per question (minutes on a CPU); lora: peft's LoRA on the top layers")
    p.add_argument("--session", action="append", help="session of the config (repeatable; default: every session "
                                                      "with labelled questions)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--minutes", type=float, default=20.0, help="time budget; training windows stop when it is spent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="reuse the states already extracted under OUT/states")
    p.add_argument("--target-precision", type=float, default=0.9)
    p.add_argument("--columns", nargs="*", help="FIELD=COLUMN for bar tables whose columns are named otherwise")
    p.add_argument("--window", type=int, default=160, help="bars per window (one session each)")
    p.add_argument("--stride", type=int, default=2, help="a decision point every STRIDE bars")
    p.add_argument("--train-windows", type=int, default=16)
    p.add_argument("--dev-windows", type=int, default=3)
    p.add_argument("--later-windows", type=int, default=4)
    p.add_argument("--judge", nargs="*", default=[], help="other instruments: Binance captures (.gz) or bar tables")
    p.add_argument("--judge-bar-seconds", type=float, help="bar interval for --judge captures (default: the session's)")
    p.add_argument("--synthetic-bars", type=int, default=160, help="synthetic bars per instrument (0: none)")
    p.add_argument("--judge-bars", type=int, help="bars per --judge / synthetic window (default: --window)")
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


def _sessions(config: Any, names: list[str] | None) -> list[SessionSpec]:
    try:
        specs = [config.session(n) for n in names] if names else list(config.sessions)
    except KeyError as exc:
        raise TuneError(str(exc.args[0])) from None
    specs = [s for s in specs if any(q.label is not None and q.choices for q in s.questions)]
    if not specs:
        raise TuneError(f"{config.source}: no session with labelled questions to tune")
    for spec in specs:
        if spec.render.mode != "bars":
            raise TuneError(f"session {spec.name!r} renders {spec.render.mode!r}; tune trains on bars")
    return specs


@dataclass(slots=True)
class Task:
    """One session of the config: its prompt, labelled questions, data and windows."""

    spec: SessionSpec
    questions: list[QuestionSpec]
    sources: dict[str, list[Any]]
    plans: list[WindowPlan]
    fingerprint: str = ""
    extractor: Any = None


def _plan(args: argparse.Namespace, spec: SessionSpec, rng: random.Random) -> Task:
    questions = [q for q in spec.questions if q.label is not None and q.choices]
    history = max(q.label.bars_needed for q in questions)
    if args.window <= history:
        raise TuneError(f"--window {args.window} leaves no decision point after the labels' {history}-bar history")
    bar_s = float(spec.render.bar_seconds or 60)
    files = [d for d in args.data if not d.startswith("synthetic")]
    sources = load_bars(files, instrument=spec.instrument, bar_seconds=bar_s, columns=_columns(args.columns))
    for d in args.data:  # "synthetic:SEED": the seeded synthetic market's bars for the session's instrument
        if d.startswith("synthetic"):
            try:
                seed = int(d.partition(":")[2] or 0)
            except ValueError:
                raise TuneError(f"--data {d}: write synthetic:SEED with an integer seed") from None
            if args.synthetic_bars > 0 and seed == args.seed + 1:
                raise TuneError(f"--data {d}: seed {seed} is the judged synthetic market (--seed + 1); use another")
            bars_each = (args.train_windows + args.dev_windows + args.later_windows) * args.window * 2
            simulated = synthetic_bars(seed, bars_each, bar_s)
            name = f"synthetic:{spec.instrument}"
            if name not in simulated:
                raise TuneError(f"--data {d}: the synthetic market has no {spec.instrument!r} "
                                f"(has {sorted(simulated)})")
            sources[f"synthetic-{seed}:{spec.instrument}"] = simulated[name]
    plans: list[WindowPlan] = []
    for name, bars in sources.items():
        plans += plan_windows(name, len(bars), args.window, {"train": args.train_windows, "dev": args.dev_windows,
                                                              "later": args.later_windows}, rng)
    if not any(p.set == "train" for p in plans) or not any(p.set == "dev" for p in plans):
        raise TuneError(f"--data has too few bars for train and dev windows of {args.window} bars")
    judged = load_bars(args.judge, instrument=None, bar_seconds=args.judge_bar_seconds or bar_s, columns={})
    if args.synthetic_bars > 0:  # judged on the market of seed --seed + 1 (never a training one)
        judged.update(synthetic_bars(args.seed + 1, args.synthetic_bars, bar_s))
    for name, bars in judged.items():
        if len(bars) > history:
            plans.append(WindowPlan("synthetic" if name.startswith("synthetic") else "other", name, 0,
                                    min(len(bars), args.judge_bars or args.window)))
    sources.update(judged)
    return Task(spec, questions, sources, plans)


def run(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from tqdm import tqdm

    from streamllm.market.extract import StateExtractor, WindowStates
    from streamllm.model.loader import load_model

    if not 0 < args.target_precision <= 1:
        raise TuneError(f"--target-precision must be in (0, 1], got {args.target_precision}")
    if args.window < 2 or args.stride < 1 or args.minutes <= 0:
        raise TuneError("need --window >= 2, --stride >= 1 and --minutes > 0")
    t0 = time.perf_counter()
    config = load_config(args.questions)
    rng = random.Random(args.seed)
    tasks = [_plan(args, spec, rng) for spec in _sessions(config, args.session)]
    # The budget cuts training windows only; the judged sets after them are small and always run.
    order = {"dev": 0, "later": 1, "train": 2, "other": 3, "synthetic": 4}
    # Sessions interleaved within each set, so a spent budget leaves every session some training windows.
    work = sorted(((t, p) for t in tasks for p in t.plans),
                  key=lambda tp: (order[tp[1].set], tp[0].plans.index(tp[1]), tasks.index(tp[0])))

    loaded = loaded if loaded is not None else load_model(args.model, progress=not args.no_progress)
    states_dir = args.out / "states"
    if states_dir.exists() and not args.resume:
        for f in states_dir.glob("*.pt"):
            f.unlink()
    states_dir.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        t.fingerprint = hashlib.sha256(json.dumps([loaded.name, t.spec.system_prompt, args.stride, [
            (q.id, q.text, q.choices, q.label.text) for q in t.questions]]).encode()).hexdigest()[:12]
    if args.method == "lora":
        return _lora(args, loaded, tasks, t0)
    for t in tasks:
        t.extractor = StateExtractor(loaded, t.spec, t.questions, max_window_tokens=max(8192, t.spec.max_context_tokens))
    got: dict[tuple[str, WindowPlan], WindowStates] = {}
    budget_s = args.minutes * 60
    tokens, spent = 0, False
    bar = tqdm(work, desc="extract", unit="window", disable=args.no_progress)
    for task, plan in bar:
        path = states_dir / f"{plan.key}-{task.fingerprint}.pt"
        if path.is_file():
            got[task.spec.name, plan] = WindowStates.from_dict(torch.load(path))
            continue
        if plan.set == "train" and time.perf_counter() - t0 > budget_s and any(p.set == "train" for _, p in got):
            if not spent:
                bar.write(f"time budget {args.minutes:g} min spent: stopping at "
                          f"{sum(p.set == 'train' for _, p in got)} train windows")
            spent = True
            continue
        window = task.sources[plan.source][plan.start: plan.start + plan.bars]
        states = task.extractor.extract(window, stride=args.stride)
        torch.save(states.to_dict(), path)  # the checkpoint: --resume starts after it
        got[task.spec.name, plan] = states
        tokens += states.tokens
        bar.set_postfix(set=plan.set, tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return _fit_and_write(args, loaded, tasks, got, time.perf_counter() - t0, tokens, t0)


def _lora(args: argparse.Namespace, loaded: Any, tasks: list[Task], t0: float) -> dict[str, Any]:
    from streamllm.market.tune_lora import run_lora
    from streamllm.model.adapter import CARD_FILE

    # The lower layers' states depend on these; the adapter's training settings do not.
    fingerprint = f"L{args.lora_layers}"
    try:
        card = run_lora(args, loaded, tasks, t0, fingerprint)
    except ValueError as exc:
        raise TuneError(str(exc)) from exc
    card["split"] = {"train": [0, SPLIT[0]], "dev": list(SPLIT), "later": [SPLIT[1], 1]}
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    return card


def _groups(tasks: list[Task]) -> list[tuple[str, QuestionSpec, list[tuple[str, str]]]]:
    """Questions by (text, choices, label) across sessions: one head each, trained on all their states
    (the engine matches a head by text and choices, so every session asking it gets the same head)."""
    groups: dict[tuple, tuple[QuestionSpec, list[tuple[str, str]]]] = {}
    for t in tasks:
        for q in t.questions:
            key = (normalize_question(q.text), q.choices, q.label.text)
            groups.setdefault(key, (q, []))[1].append((t.spec.name, q.id))
    ids = [q.id for q, _ in groups.values()]
    return [(q.id if ids.count(q.id) == 1 else f"{members[0][0]}.{q.id}", q, members)
            for q, members in groups.values()]


def _gather(got: dict, set_name: str, members: list[tuple[str, str]], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [(s.features[qid], s.labels[qid]) for (session, p), s in got.items() if p.set == set_name
             for name, qid in members if name == session]
    if not parts:
        return torch.empty(0, hidden), torch.empty(0, dtype=torch.long)
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _base_logits(extractor: Any, q: QuestionSpec, x: torch.Tensor) -> torch.Tensor:
    """The base model's own choice scores at the same states (the gate's rule, on its LM head rows)."""
    from streamllm.market.lora import ChoiceScorer

    return ChoiceScorer([q], extractor.layout.tokenizer)(q.id, x, extractor.model.lm_head)


def _fit_and_write(args, loaded, tasks, got, extract_s, tokens, t0) -> dict[str, Any]:
    from streamllm.market.headfit import calibrate_threshold, fit_head, judge
    from streamllm.model.adapter import CARD_FILE, ChoiceHead, save_heads

    hidden = loaded.config.hidden_size
    heads, report, steps = [], {}, 0
    sets = [s for s in ("dev", "later", "other", "synthetic") if any(p.set == s for _, p in got)]
    for head_id, q, members in _groups(tasks):
        x, y = _gather(got, "train", members, hidden)
        xd, yd = _gather(got, "dev", members, hidden)
        fit = fit_head(x, y, xd, yd, len(q.choices))
        steps += fit.steps
        threshold = calibrate_threshold(xd @ fit.weight.T + fit.bias, yd, args.target_precision)
        heads.append(ChoiceHead(head_id, q.text, q.choices, fit.weight, fit.bias, threshold))
        entry = {"label": q.label.text, "choices": list(q.choices), "sessions": [m[0] for m in members],
                 "l2": fit.l2, "train_samples": len(y), "judged": {}, "base_model": {},
                 "threshold": None if math.isinf(threshold) else round(threshold, 4)}
        for s in sets:
            xs, ys = _gather(got, s, members, hidden)
            entry["judged"][s] = judge(xs @ fit.weight.T + fit.bias, ys, q.choices, threshold, args.target_precision)
            entry["base_model"][s] = judge(_base_logits(tasks[0].extractor, q, xs), ys, q.choices, math.inf,
                                           args.target_precision)
        report[head_id] = entry
    path = save_heads(args.out, heads, model=loaded.name)
    card = {
        "method": "head", "model": loaded.name, "config": str(args.questions), "sessions": [t.spec.name for t in tasks],
        "data": [str(d) for d in args.data], "judge": [str(d) for d in args.judge], "seed": args.seed,
        "window_bars": args.window, "stride": args.stride, "split": {"train": [0, SPLIT[0]], "dev": list(SPLIT),
                                                                     "later": [SPLIT[1], 1]},
        "windows": {s: sorted(f"{n}/{p.key}" for n, p in got if p.set == s) for s in ("train", *sets)},
        "decision_points": {s: sum(len(y) for (_, p), st in got.items() if p.set == s for y in st.labels.values())
                            for s in ("train", *sets)},
        "target_precision": args.target_precision, "fit_steps": steps, "tokens_extracted": tokens,
        "tokens_all_windows": sum(st.tokens for st in got.values()),  # this run's and --resume'd checkpoints
        "minutes": round((time.perf_counter() - t0) / 60, 2), "extract_minutes": round(extract_s / 60, 2),
        "adapter_bytes": path.stat().st_size, "questions": report,
    }
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    return card


def _card_intro(card: dict[str, Any]) -> list[str]:
    data = (f"Data: {', '.join(card['data'])}; judged also on {', '.join(card['judge']) or 'no captures'} and "
            f"synthetic regimes. Windows of {card['window_bars']} bars, a decision point every {card['stride']} bars; "
            f"decision points per set: {card['decision_points']}.")
    if card["method"] == "lora":
        lo = card["lora"]
        return [f"# LoRA for {card['config']} (sessions {', '.join(card['sessions'])})", "",
                f"Method `lora` on `{card['model']}`: peft LoRA r={lo['rank']} alpha={lo['alpha']} on every projection "
                f"of layers {lo['adapted_layers'][0]}-{lo['adapted_layers'][-1]}, merged into the weights at load. "
                f"This run: {card['minutes']} min ({card['train_minutes']} preparing and training), {card['steps']} "
                f"steps of {lo['points']} decision points (lr {lo['lr']}, KL {lo['kl']}, bf16 autocast "
                f"{lo['autocast_bf16']}); best dev loss {card['best_dev_loss']} at step {card['best_step']}; "
                f"{card['adapter_bytes']} bytes.", data, "",
                "The gate scores a choice by its best first token's logit (the engine's own rule); threshold: the "
                f"margin reaching precision {card['target_precision']} on the dev range (none: never on at least 10 "
                "fired samples). Base model: the same rule on the unadapted model, its own dev threshold. Questions "
                "named adhoc_* were never trained on: they show whether the model stayed general.", ""]
    return [f"# Choice heads for {card['config']} (sessions {', '.join(card['sessions'])})", "",
            f"Method `{card['method']}` on `{card['model']}`: a readout over the final normed hidden state at each "
            f"question's decision point. This run: {card['minutes']} min ({card['extract_minutes']} extracting "
            f"{card['tokens_extracted']} tokens; all windows, resumed ones included: {card['tokens_all_windows']} "
            f"tokens), {card['fit_steps']} LBFGS steps, {card['adapter_bytes']} bytes.", data, "",
            f"Gate threshold: the head's margin reaching precision {card['target_precision']} on the dev range "
            "(none: it never did on at least 10 fired samples, so the gate stays closed).", ""]


def card_markdown(card: dict[str, Any]) -> str:
    lines = _card_intro(card) + [
             "| question | set | n | accuracy | base rate | base model acc | coverage @thr | precision @thr | "
             "coverage at target (own) |", "|---|---|---|---|---|---|---|---|---|"]
    for qid, q in card["questions"].items():
        for s, j in q["judged"].items():
            if not j.get("samples"):
                continue
            base = q["base_model"][s]
            lines.append(f"| {qid} | {s} | {j['samples']} | {j['accuracy']:.2f} | {j['base_rate']:.2f} ({j['majority']}) "
                         f"| {base['accuracy']:.2f} | {j['coverage']:.2f} | "
                         f"{'-' if j['precision'] is None else format(j['precision'], '.2f')} | {j['coverage_at_target']:.2f} |")
    lines += ["", "Thresholds: " + ", ".join(f"{qid} {q['threshold']}" for qid, q in card["questions"].items()), ""]
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        card = run(args)
    except (TuneError, ConfigError) as exc:
        print(f"streamllm tune: error: {exc}", file=sys.stderr)
        return 2
    print(card_markdown(card))
    made = "lora/ (peft)" if card["method"] == "lora" else "head.safetensors"
    print(f"wrote {args.out}/{made}, card.json, card.md")
    return 0
