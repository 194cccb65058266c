"""`streamllm tune`: teach the session model a config's labelled questions from recorded bars.

`--method series` (the default, minutes on a CPU) learns one series head per labelled
question: a readout over the session's last K lines, each line read as the residual
stream at one layer over its tokens (engine/taps.py, model/seriesfit.py). The model
reads the numbers; the head weighs them across lines, which a 135M model's single
decision-point state does not do well. `--method head` learns a readout W h + b over
the final normed hidden state h at the question's decision point (the LM head's rows
for its choices re-trained; convex, tuning/headfit.py). `--method lora` adapts the
model itself (tuning/lora_run.py). States come from the engine's own prompt layout,
model, runner and KV store (streamllm/tuning/extract.py).

Time split, per data file (no window straddles a boundary):

    bars: |------------- train (70%) -------------|-- dev (10%) --|---- later (20%) ----|
           fit the heads                            L2, threshold    judged only
    --mix: |- train windows anywhere -|      (more markets, for training; --mix-dev-windows: dev windows
                                              of a table too, none overlapping a training one)

Files are read as every command reads them (feeds/sources.open_source, the shared read
flags): bar tables and Databento OHLCV at their own interval, trades (tables, DBN,
captures) as bars of the session's interval. Judged as well on other instruments
(`--judge` files, rendered into bars as the configs do) and on synthetic regimes
(feeds/synthetic.py).
Every window's states go to the state cache (tuning/cache.py), keyed by what they depend on and
shared by every question, config and run; `--no-cache` keeps them under OUT/states instead, where
`--resume` reuses them. A window's labels are computed from its bars on every run (never cached).
Writes OUT/head.safetensors (KBs), OUT/card.json and OUT/card.md.

    tune.py       the command: arguments, sessions, each session's windows, extraction
    cache.py      the state cache: windows' states and series fits, by what they depend on
    data.py       what the windows are cut from: files, time ranges, synthetic markets, --mix-as
    fit.py        the heads fitted, judged and written with their card
    lora_run.py   --method lora
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from streamllm.config import SessionSpec, load_config
from streamllm.model.adapter import CARD_FILE
from streamllm.model.loader import load_model
from streamllm.tuning.cache import StateCache, default_root, lines_name, points_name
from streamllm.tuning.card import card_markdown
from streamllm.tuning.data import (
    BASE_MODEL_SETS,
    SPLIT,
    Task,
    TuneError,
    Variant,
    WindowPlan,
    describe,
    load_bars,
    load_sources,
    plan_windows,
    read_opts,
    spread,
    synthetic_bars,
)
from streamllm.tuning.extract import (
    CHUNK_TOKENS,
    StateExtractor,
    WindowStates,
    render_window,
    window_labels,
)
from streamllm.tuning.fit import fit_and_write
from streamllm.tuning.lora_run import run_lora

if TYPE_CHECKING:
    import argparse

# -- the run ----------------------------------------------------------------------------


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
    units = {s.name: s.render.changes for s in specs}
    if len(set(units.values())) > 1:  # one adapter reads one kind of line (model/adapter.check_sessions)
        raise TuneError(f"{config.source}: sessions write changes in different units ({units}); tune each "
                        "into its own adapter with --session")
    return specs


def _check_variants(variants: list[Variant], specs: list[SessionSpec]) -> None:
    """Each --mix-as variant is one source (its bars), and `for=` names labelled questions."""
    labelled = sorted({q.id for spec in specs for q in spec.questions if q.label is not None and q.choices})
    names = [str(v) for v in variants]
    for v in variants:
        if names.count(str(v)) > 1:
            raise TuneError(f"--mix-as: {names.count(str(v))} variants show the same bars ({v}); "
                            "name every question in one for=ID+ID")
        if unknown := [q for q in v.only if q not in labelled]:
            raise TuneError(f"--mix-as {v}: for={'+'.join(unknown)} is not a labelled question of the config "
                            f"(labelled: {', '.join(labelled)})")


def _plan(args: argparse.Namespace, spec: SessionSpec, rng: random.Random) -> Task:
    questions = [q for q in spec.questions if q.label is not None and q.choices]
    history = max(q.label.bars_needed for q in questions)
    if args.window <= history:
        raise TuneError(f"--window {args.window} leaves no decision point after the labels' {history}-bar history")
    bar_s = float(spec.render.bar_seconds or 60)
    sources = load_sources(args, spec, "--data", args.data, args.train_windows + args.dev_windows + args.later_windows)
    plans: list[WindowPlan] = []
    for name, bars in sources.items():
        plans += plan_windows(name, len(bars), args.window, {"train": args.train_windows, "dev": args.dev_windows,
                                                              "later": args.later_windows}, rng)
    # --mix: more markets for training (and with --mix-dev-windows for dev; never later: that is --data's).
    mixed = load_sources(args, spec, "--mix", args.mix, args.mix_windows)
    tables = {name for name in mixed if not name.startswith("synthetic-")}
    teaches: dict[str, tuple[str, ...]] = {}
    for name, bars in list(sources.items()):  # --mix-as: --data's own training range as other markets show it
        for variant in args.mix_as:
            mixed[f"{name}@{variant}"] = variant.apply(bars[: int(SPLIT[0] * len(bars))])
            teaches[f"{name}@{variant}"] = variant.only
    for name, bars in mixed.items():
        if name in sources:
            raise TuneError(f"--mix {name} is also in --data")
        # A table draws its windows from its own generator, so adding one moves no other window
        # (and no other window's extracted states).
        draw = random.Random(f"{args.seed}:{name}") if name in tables else rng
        train = [dataclasses.replace(p, mixed=True, teaches=teaches.get(name, ())) for p in
                 plan_windows(name, len(bars), args.window, {"train": args.mix_windows}, draw, whole=True)]
        if not train:
            raise TuneError(f"--mix {name}: {len(bars)} bars hold no window of {args.window}")
        plans += train
        if name in tables:
            plans += _mix_dev(name, len(bars), train, args)
    sources.update(mixed)
    if not any(p.set == "train" for p in plans) or not any(p.set == "dev" for p in plans):
        raise TuneError(f"--data has too few bars for train and dev windows of {args.window} bars")
    # --judge files are other markets: their own column names, their own --judge-time-format
    judged = load_bars(args.judge, opts=read_opts(args, columns={}, time_format=args.judge_time_format),
                       bar_seconds=args.judge_bar_seconds or bar_s)
    if args.synthetic_bars > 0:  # judged on the market of seed --seed + 1 (never a training one)
        judged.update(synthetic_bars(args.seed + 1, args.synthetic_bars, bar_s))
    for name, bars in judged.items():
        size = min(len(bars), args.judge_bars or args.window)
        if size <= history:
            continue
        synthetic = name.startswith("synthetic")
        plans += [WindowPlan("synthetic" if synthetic else "other", name, start, size)
                  for start in spread(len(bars), size, 1 if synthetic else args.judge_windows)]
    sources.update(judged)
    for name, bars in sources.items():  # what each file became, before minutes of extraction
        if not name.startswith("synthetic"):  # a synthetic market is its seed
            print(f"streamllm tune: session {spec.name}: {describe(name, bars)}", file=sys.stderr)
    return Task(spec, questions, sources, plans)


def _mix_dev(name: str, n_bars: int, train: list[WindowPlan], args: argparse.Namespace) -> list[WindowPlan]:
    """--mix-dev-windows: development windows from a --mix table, none overlapping one of its training
    windows (and none touching one, where the table leaves room), so the development loss that picks
    each head's features, weight decay and best step (and calibrates its gate) judges the other markets
    it trains on too, not only --data's."""
    taken = {p.start // args.window for p in train}  # training slots (windows anywhere: slot * window)
    free = [s for s in range(n_bars // args.window) if s not in taken]
    apart = [s for s in free if not {s - 1, s + 1} & taken]
    draw = random.Random(f"{args.seed}:{name}:dev")
    picks = draw.sample(apart, min(args.mix_dev_windows, len(apart)))
    rest = [s for s in free if s not in apart]
    picks += draw.sample(rest, min(args.mix_dev_windows - len(picks), len(rest)))
    if len(picks) < args.mix_dev_windows:
        print(f"streamllm tune: --mix {name}: room for {len(picks)} of --mix-dev-windows {args.mix_dev_windows} "
              f"beside its training windows", file=sys.stderr)
    return [WindowPlan("dev", name, s * args.window, args.window, mixed=True) for s in sorted(picks)]


def run(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from tqdm import tqdm

    if not 0 < args.target_precision <= 1:
        raise TuneError(f"--target-precision must be in (0, 1], got {args.target_precision}")
    if (args.window < 2 or args.stride < 1 or args.minutes <= 0 or args.judge_windows < 1 or args.mix_dev_windows < 0
            or args.base_model_windows < 0):
        raise TuneError("need --window >= 2, --stride >= 1, --minutes > 0, --judge-windows >= 1, "
                        "--mix-dev-windows >= 0 and --base-model-windows >= 0")
    if args.method == "series" and (args.lines < 1 or args.series_rank < 1 or args.fit_orders < 1
                                    or args.window <= args.lines or getattr(args, "reduce", 0) < 0):
        raise TuneError(f"--method series needs --lines >= 1, --series-rank >= 1, --fit-orders >= 1, --reduce >= 0 "
                        f"and --window > --lines (got {args.lines}, {args.series_rank}, {args.fit_orders}, "
                        f"{getattr(args, 'reduce', 0)}, {args.window})")
    if args.mix_dev_windows and all(m.startswith("synthetic") for m in args.mix):
        print("streamllm tune: --mix-dev-windows: no --mix table to draw them from (synthetic markets and "
              "--mix-as variants train only)", file=sys.stderr)
    t0 = time.perf_counter()
    config = load_config(args.questions)
    _check_variants(args.mix_as, _sessions(config, args.session))
    rng = random.Random(args.seed)
    tasks = [_plan(args, spec, rng) for spec in _sessions(config, args.session)]
    # The budget cuts training windows only. Every judged set runs first, so that the time left when
    # training starts is what training gets, and the run ends near its budget.
    order = {"dev": 0, "later": 1, "other": 2, "synthetic": 3, "train": 4}
    # Sessions interleaved within each set, so a spent budget leaves every session some training windows.
    work = sorted(((t, p) for t in tasks for p in t.plans),
                  key=lambda tp: (order[tp[1].set], tp[0].plans.index(tp[1]), tasks.index(tp[0])))

    loaded = loaded if loaded is not None else load_model(args.model, progress=not args.no_progress)
    if args.method == "lora":
        states_dir = args.out / "states"
        if states_dir.exists() and not args.resume:
            for f in states_dir.glob("*.pt"):
                f.unlink()
        states_dir.mkdir(parents=True, exist_ok=True)
        for t in tasks:
            t.fingerprint = states_fingerprint(args, loaded.name, t)
        return _lora(args, loaded, tasks, t0)
    layers = loaded.config.num_hidden_layers
    if args.method == "series" and not 0 <= args.tap_layer <= layers:
        raise TuneError(f"--tap-layer {args.tap_layer} is outside 0..{layers} ({loaded.name} has {layers} layers)")
    for t in tasks:
        history = max(q.label.bars_needed for q in t.questions)
        if args.method == "series" and args.lines < history:
            raise TuneError(f"--lines {args.lines} is shorter than the labels' {history}-bar history "
                            f"(session {t.spec.name})")
    for t in tasks:
        t.extractor = StateExtractor(loaded, t.spec, t.questions, max_window_tokens=max(8192, t.spec.max_context_tokens),
                                     tap_layer=args.tap_layer if args.method == "series" else None, dtype=args.dtype,
                                     words=args.words if args.method == "series" else ())
    work = [(t, _fitted(t, p, args)) for t, p in work]  # checked before any extraction, not 20 minutes in
    work = [(t, p) for t, p in work if p is not None]
    pointed = _pointed(work, args)
    cache = _open_cache(args, loaded, tasks[0].extractor)
    got: dict[tuple[str, WindowPlan], WindowStates] = {}
    budget_s = args.minutes * 60
    tokens, extracting_s, spent = 0, 0.0, False
    bar = tqdm(work, desc="extract", unit="window", disable=args.no_progress)
    for task, plan in bar:
        over = (plan.set == "train" and time.perf_counter() - t0 > budget_s and any(p.set == "train" for _, p in got))
        try:
            states, computed, seconds = _window_states(task, plan, args, cache, extract=not over,
                                                       pointed=(task.spec.name, plan) in pointed)
        except ValueError as exc:  # a window longer than the session's context
            raise TuneError(f"{plan.set} window {plan.key}: {exc}; use a smaller --window") from None
        if states is None:
            if not spent:
                bar.write(f"time budget {args.minutes:g} min spent: stopping at "
                          f"{sum(p.set == 'train' for _, p in got)} train windows")
            spent = True
            continue
        got[task.spec.name, plan] = states
        tokens += computed
        extracting_s += seconds
        bar.set_postfix(set=plan.set, read=cache.hits, extracted=cache.misses + cache.partial,
                        tok_s=f"{tokens / max(extracting_s, 1e-9):.0f}")
    bar.close()
    print(f"streamllm tune: {cache.summary()}; {tokens:,} tokens in {extracting_s:.0f} s"
          + (f" ({tokens / extracting_s:.0f} tokens/s)" if extracting_s else ""), file=sys.stderr)
    return fit_and_write(args, loaded, tasks, got, time.perf_counter() - t0, tokens, t0, cache)


def _open_cache(args: argparse.Namespace, loaded: Any, extractor: StateExtractor) -> StateCache:
    """The shared cache (--cache-dir, else cache.default_root()), or with --no-cache this run's own
    checkpoints under OUT/states: cleared first unless --resume."""
    root = args.out / "states" if args.no_cache else (args.cache_dir or default_root())
    cache = StateCache(root, loaded, dtype=extractor.model.dtype_choice.name, device=str(extractor.model.device),
                       chunk_tokens=CHUNK_TOKENS)
    if args.no_cache and not args.resume:
        for f in [*cache.dir.glob("window-*"), *cache.dir.glob("fit-*")]:
            f.unlink()
    return cache


def _pointed(work: list[tuple[Task, WindowPlan]], args: argparse.Namespace) -> set[tuple[str, WindowPlan]]:
    """The windows whose decision points are extracted: every window's with --method head (they are its
    inputs); with series, for the base model's column on the card only, the first --base-model-windows
    windows of each judged source. Those run the whole model and a branch per decision point, about four
    times a window read for its lines alone, which stops at the tap layer."""
    if args.method == "head":
        return {(t.spec.name, p) for t, p in work}
    if not args.base_model:
        return set()
    taken: dict[tuple[str, str, str], int] = {}
    out = set()
    for t, p in work:
        if p.set in BASE_MODEL_SETS:
            slot = (t.spec.name, p.set, p.source)
            if taken.get(slot, 0) < args.base_model_windows:
                taken[slot] = taken.get(slot, 0) + 1
                out.add((t.spec.name, p))
    return out


def decision_bars(n_bars: int, stride: int, labels: list[int]) -> list[int]:
    """Every stride-th bar (bar stride-1, 2*stride-1, ...) whose label is known: the same bars whatever
    other questions a config holds, so one question's cached decision points serve every config."""
    return [i for i in range(stride - 1, n_bars, stride) if labels[i] >= 0]


def _window_states(task: Task, plan: WindowPlan, args: argparse.Namespace, cache: StateCache, *,
                   extract: bool, pointed: bool) -> tuple[WindowStates | None, int, float]:
    """One window's states: from the cache where it has them, else extracted (and then cached); with the
    tokens computed and the seconds it took. None when something is missing and `extract` is False.
    `pointed`: its decision points' states too (`_pointed`); otherwise it is read for its lines alone."""
    ex = task.extractor
    window = task.sources[plan.source][plan.start: plan.start + plan.bars]
    ids, ends = ex.session_ids(render_window(window, task.spec.render.changes))
    key = cache.key(ids, ends, len(ex.prefix))
    labels = window_labels(task.questions, window)
    at = {q.id: decision_bars(len(window), args.stride, labels[q.id]) for q in task.questions}
    names = {q.id: points_name(ex.question_ids[q.id]) for q in task.questions}
    lines = lines_name(args.tap_layer, args.words) if args.method == "series" else None
    tensors, cost = cache.read(key)
    held_any = bool(tensors)
    missing = {}
    for q in task.questions if pointed else ():
        held = set(tensors.get(f"{names[q.id]}.bars", torch.empty(0)).tolist())
        if need := [i for i in at[q.id] if i not in held]:
            missing[q.id] = need
    computed, seconds = 0, 0.0
    if (lines is not None and lines not in tensors) or missing:
        if not extract:
            return None, 0, 0.0
        started = time.perf_counter()
        new_lines, hidden, computed = ex.extract_parts(window, missing)
        seconds = time.perf_counter() - started
        if lines is not None and lines not in tensors:
            tensors[lines] = new_lines
        share = seconds / computed  # seconds per token: each part's cost, for the card's totals
        cost["session"] = [len(ids), len(ids) * share]
        for qid, need in missing.items():
            name = names[qid]
            rows = dict(zip(tensors.get(f"{name}.bars", torch.empty(0, dtype=torch.long)).tolist(),
                            tensors.get(f"{name}.hidden", torch.empty(0, hidden[qid].shape[1])), strict=True))
            rows.update(zip(need, hidden[qid], strict=True))
            tensors[f"{name}.bars"] = torch.tensor(sorted(rows), dtype=torch.long)
            tensors[f"{name}.hidden"] = torch.stack([rows[i] for i in sorted(rows)])
            branch = len(ex.question_ids[qid]) * len(need)
            cost[name] = [cost.get(name, [0, 0.0])[0] + branch, cost.get(name, [0, 0.0])[1] + branch * share]
        cache.misses += not held_any
        cache.partial += held_any
        cache.write(key, tensors, cost, {"source": plan.source, "start": plan.start, "bars": plan.bars,
                                         "system_prompt": task.spec.system_prompt,
                                         "render": dataclasses.asdict(task.spec.render), "tokens": len(ids),
                                         "questions": {q.text: names[q.id] for q in task.questions}})
    else:
        cache.hits += 1
    states = WindowStates({}, {}, {}, 0, tensors.get(lines) if lines else None)
    states.tokens = int(cost.get("session", [0, 0])[0])
    states.seconds = float(cost.get("session", [0, 0.0])[1])
    for q in task.questions:
        states.labels[q.id] = torch.tensor([labels[q.id][i] for i in at[q.id]], dtype=torch.long)
        states.bars[q.id] = torch.tensor(at[q.id], dtype=torch.long)
        if pointed:
            name = names[q.id]
            row = {b: k for k, b in enumerate(tensors[f"{name}.bars"].tolist())}
            states.features[q.id] = tensors[f"{name}.hidden"][[row[i] for i in at[q.id]]]
            states.tokens += len(ex.question_ids[q.id]) * len(at[q.id])
            states.seconds += cost[name][1] * len(at[q.id]) / max(len(row), 1)
    if lines:
        states.line_labels = {qid: torch.tensor(y) for qid, y in labels.items()}
    return states, computed, seconds


def _fitted(task: Task, plan: WindowPlan, args: argparse.Namespace) -> WindowPlan | None:
    """The plan if its window fits the session's context; a --mix window is trimmed to the bars that
    fit (another market's lines may be longer: the synthetic one writes trade counts and buy shares),
    or dropped when too few would; any other window over it is an error, before anything is extracted."""
    limit = task.extractor.max_window_tokens
    lines = render_window(task.sources[plan.source][plan.start: plan.start + plan.bars], task.spec.render.changes)
    ids, ends = task.extractor.session_ids(lines)
    if len(ids) <= limit:
        return plan
    if not plan.mixed:
        raise TuneError(f"{plan.set} window {plan.key}: {plan.bars} bars are {len(ids)} tokens, over the "
                        f"session's {limit}; use a smaller --window")
    fit = sum(1 for end in ends if end <= limit)
    history = max(q.label.bars_needed for q in task.questions)
    if fit <= max(history, args.lines if args.method == "series" else 0):
        print(f"streamllm tune: --mix window {plan.key} skipped: only {fit} bars fit {limit} tokens", file=sys.stderr)
        return None
    return dataclasses.replace(plan, bars=fit)


def states_fingerprint(args: argparse.Namespace, model_name: str, task: Task) -> str:
    """What a window's checkpointed states depend on, so `--resume` never reuses another run's: the
    model, the prompt, how lines are rendered (price units or basis points), the stride, the tap
    and the questions."""
    tap = [args.tap_layer, list(args.words)] if args.method == "series" else None
    render = dataclasses.astuple(task.spec.render)  # every render option: mode, bar_seconds, changes
    return hashlib.sha256(json.dumps([model_name, task.spec.system_prompt, render, args.stride, tap, [
        (q.id, q.text, q.choices, q.label.text) for q in task.questions]]).encode()).hexdigest()[:12]


def _lora(args: argparse.Namespace, loaded: Any, tasks: list[Task], t0: float) -> dict[str, Any]:
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
