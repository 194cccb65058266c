"""Fitting the heads on a tuning run's extracted states, judging them, and writing the adapter and its card.

One head per labelled question (grouped across sessions by text, choices and label): an entry
head (tuning/headfit.py) or a series head (model/seriesfit.py), its gate threshold calibrated
on the development range, then judged on every set through the served head itself. A series fit
on exactly the samples and settings of one kept in the state cache is read from it (tuning/cache.py).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from streamllm.config import QuestionSpec, normalize_question
from streamllm.evaluation.intervals import block_ids
from streamllm.model import seriesfit
from streamllm.model.adapter import CARD_FILE, ChoiceHead, SeriesHead, save_heads
from streamllm.model.seriesfit import Samples, SeriesFit, feature_sets, fit_series, samples
from streamllm.tuning.cache import StateCache, samples_key
from streamllm.tuning.card import card_markdown
from streamllm.tuning.data import BASE_MODEL_SETS, SPLIT, Task, WindowPlan
from streamllm.tuning.headfit import calibrate_threshold, fit_head, judge
from streamllm.tuning.lora import ChoiceScorer


def groups(tasks: list[Task]) -> list[tuple[str, QuestionSpec, list[tuple[str, str]]]]:
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


def in_set(plan: WindowPlan, set_name: str) -> bool:
    """"other/SOURCE" names one judged source inside the "other" set."""
    return plan.set == set_name or f"{plan.set}/{plan.source}" == set_name


def taught(plan: WindowPlan, session: str, members: list[tuple[str, str]]) -> list[str]:
    """The question ids of a head's members that learn from (or are judged on) a window of `session`:
    all of them, but a `--mix-as ...,for=ID` window only the questions it names."""
    return [qid for name, qid in members if name == session and (not plan.teaches or qid in plan.teaches)]


def _gather(got: dict, set_name: str, members: list[tuple[str, str]], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decision points' states and labels of a set's windows that hold them (with --method series, the
    judged windows the base model's column reads: tune._pointed)."""
    parts = [(s.features[qid], s.labels[qid]) for (session, p), s in got.items() if in_set(p, set_name)
             for qid in taught(p, session, members) if qid in s.features]
    if not parts:
        return torch.empty(0, hidden), torch.empty(0, dtype=torch.long)
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _base_logits(extractor: Any, q: QuestionSpec, x: torch.Tensor) -> torch.Tensor:
    """The base model's own choice scores at the same states (the gate's rule, on its LM head rows)."""
    return ChoiceScorer([q], extractor.layout.tokenizer)(q.id, x, extractor.model.lm_head)


def _fit_entry(args, head_id, q, members, got, sets, hidden):
    """An entry head: logistic regression on the decision points' states."""
    x, y = _gather(got, "train", members, hidden)
    xd, yd = _gather(got, "dev", members, hidden)
    fit = fit_head(x, y, xd, yd, len(q.choices))
    threshold = calibrate_threshold(xd @ fit.weight.T + fit.bias, yd, args.target_precision)
    head = ChoiceHead(head_id, q.text, q.choices, fit.weight, fit.bias, threshold)

    def scores(set_name):  # decision points: no bar order kept, so no intervals
        xs, ys = _gather(got, set_name, members, hidden)
        return head.logits(xs), ys, None

    return head, {"l2": fit.l2, "train_samples": len(y), "steps": fit.steps}, scores


def _reduce(args) -> int | None:
    """--reduce: the principal components a wide feature set is fitted through (None: every column)."""
    d = getattr(args, "reduce", seriesfit.REDUCE)
    return d or None


def _series_fit(train: Samples, dev: Samples, classes: int, args, hidden: int, cache: StateCache | None,
                q: QuestionSpec) -> tuple[SeriesFit, bool]:
    """fit_series, or the fit it gave before on exactly these samples and settings (the fit is deterministic,
    so a kept one is the one it would give again); True when kept."""
    settings = {"classes": classes, "k": args.lines, "rank": args.series_rank, "seed": args.seed,
                "sets": len(args.words), "hidden": hidden, "orders": args.fit_orders, "choose": args.choose,
                "constants": [seriesfit.STEPS, seriesfit.BATCH, seriesfit.EVAL_EVERY, seriesfit.LR,
                              list(seriesfit.WEIGHT_DECAY)], "reduce": _reduce(args), "version": seriesfit.FIT_VERSION,
                "torch": torch.__version__}
    key = None
    if cache is not None:
        key = samples_key(settings, *(getattr(s, f) for s in (train, dev)
                                      for f in ("lines", "index", "labels", "reads", "window")))
        tensors, notes = cache.read(key, "fit")
        if tensors:
            candidates = {(n, w): (m, se) for n, w, m, se in notes["candidates"]}
            return SeriesFit(tensors["proj"], tensors["proj_bias"], tensors["lags"], tensors["bias"],
                             notes["weight_decay"], notes["steps"], notes["dev_loss"], notes["features"],
                             candidates), True
    fit = fit_series(train, dev, classes, k=args.lines, rank=args.series_rank, seed=args.seed,
                     sets=feature_sets(hidden, len(args.words)), orders=args.fit_orders, choose=args.choose,
                     reduce=_reduce(args))
    if cache is not None:
        notes = {"weight_decay": fit.weight_decay, "steps": fit.steps, "dev_loss": fit.dev_loss,
                 "features": fit.features, "candidates": [[n, w, m, se] for (n, w), (m, se) in fit.candidates.items()]}
        cache.write(key, {"proj": fit.proj, "proj_bias": fit.proj_bias, "lags": fit.lags, "bias": fit.bias}, notes,
                    {"question": q.text, "label": q.label.text, "choices": list(q.choices),
                     "train_samples": len(train), "dev_samples": len(dev), **settings}, kind="fit")
    return fit, False


def _fit_series(args, head_id, q, members, got, sets, hidden, cache=None):
    """A series head: every bar of every window, read over its last --lines lines (model/seriesfit.py),
    or over all of a window's first lines once its label is known (a session's start, as served)."""
    def gather(set_name, least=1):
        return samples([(st.lines, st.line_labels[qid]) for (session, p), st in got.items() if in_set(p, set_name)
                        for qid in taught(p, session, members)], args.lines, least)

    train, dev = gather("train"), gather("dev")
    fit, cached = _series_fit(train, dev, len(q.choices), args, hidden, cache, q)
    least = int(train.reads.min())  # the label's history: fewer lines never had a label to learn from
    head = SeriesHead(head_id, q.text, q.choices, args.tap_layer, fit.proj, fit.proj_bias, fit.lags, fit.bias,
                      math.inf, tuple(args.words), least if least < args.lines else 0)
    head.threshold = calibrate_threshold(dev.logits(head), dev.labels, args.target_precision)

    judged = functools.cache(lambda set_name: gather(set_name, least))  # both views of a set, gathered once

    def scores(set_name, first_lines=False):  # judged through the served head itself: the engine's numbers
        got_set = judged(set_name)
        got_set = got_set.subset((got_set.reads < args.lines) == first_lines)
        return got_set.logits(head), got_set.labels, block_ids(got_set.window.numpy(), got_set.index[:, -1].numpy(), q.label.bars_needed)

    return head, {"fit_cached": cached, "weight_decay": fit.weight_decay, "features": fit.features, "train_samples": len(train),
                  "min_lines": least, "steps": fit.steps, "dev_loss": round(fit.dev_loss, 4),
                  "candidates": {f"{n}/{w:g}": [round(m, 4), round(se, 4)] for (n, w), (m, se) in fit.candidates.items()}}, scores


def fit_and_write(args, loaded, tasks, got, extract_s, tokens, t0, cache: StateCache | None = None) -> dict[str, Any]:
    hidden = loaded.config.hidden_size
    heads, report, steps = [], {}, 0
    sets = [s for s in ("dev", "later", "other", "synthetic") if any(p.set == s for _, p in got)]
    # Each market of a pooled set on its own too, after it: a pooled figure can hide one (other: the
    # --judge markets; dev: --data's and, with --mix-dev-windows, each --mix table's).
    for pooled in ("other", "dev"):
        sources = sorted({p.source for _, p in got if p.set == pooled})
        if len(sources) > 1:
            at = sets.index(pooled) + 1
            sets[at:at] = [f"{pooled}/{src}" for src in sources]
    # A series fit is minutes a question (candidates x orders x AdamW steps): say which one is running.
    bar = tqdm(groups(tasks), desc="fit", unit="question", disable=getattr(args, "no_progress", False))
    for head_id, q, members in bar:
        bar.set_postfix(question=head_id)
        if args.method == "series":
            head, entry, scores = _fit_series(args, head_id, q, members, got, sets, hidden, cache)
        else:
            head, entry, scores = _fit_entry(args, head_id, q, members, got, sets, hidden)
        steps += entry.pop("steps")
        heads.append(head)
        entry.update({"label": q.label.text, "choices": list(q.choices), "sessions": [m[0] for m in members],
                      "judged": {}, "base_model": {},
                      "threshold": None if math.isinf(head.threshold) else round(head.threshold, 4)})
        for s in sets:
            logits, ys, blocks = scores(s)
            entry["judged"][s] = judge(logits, ys, q.choices, head.threshold, args.target_precision, blocks)
            if args.method == "series":  # a session's first lines, apart: the main figures stay whole windows
                logits, ys, blocks = scores(s, first_lines=True)
                if len(ys):
                    entry.setdefault("first_lines", {})[s] = judge(logits, ys, q.choices, head.threshold,
                                                                   args.target_precision, blocks)
            if args.method == "series" and (not args.base_model or s.split("/")[0] not in BASE_MODEL_SETS):
                continue  # --no-base-model, or a development set: no decision points (data.BASE_MODEL_SETS)
            xs, ys = _gather(got, s, members, hidden)  # the base model at the decision points
            entry["base_model"][s] = judge(_base_logits(tasks[0].extractor, q, xs), ys, q.choices, math.inf,
                                           args.target_precision)
        report[head_id] = entry
    if args.method == "series":
        kept = [qid for qid, e in report.items() if e.get("fit_cached")]
        print(f"streamllm tune: {len(report) - len(kept)} heads fitted, {len(kept)} read from the state cache"
              + (f" ({', '.join(kept)})" if kept else ""), file=sys.stderr)
    path = save_heads(args.out, heads, model=loaded.name, changes=tasks[0].spec.render.changes)
    card = {
        "method": args.method, "model": loaded.name, "dtype": tasks[0].extractor.model.dtype_choice.name, "config": str(args.questions), "sessions": [t.spec.name for t in tasks],
        "changes": tasks[0].spec.render.changes,
        "data": [str(d) for d in args.data], "mix": [str(d) for d in args.mix] + [f"--data as {v}" + (f" for {'+'.join(v.only)}" if v.only else "")
                                             for v in args.mix_as],
        "judge": [str(d) for d in args.judge], "seed": args.seed,
        "window_bars": args.window, "stride": args.stride, "split": {"train": [0, SPLIT[0]], "dev": list(SPLIT),
                                                                     "later": [SPLIT[1], 1]},
        "windows": {s: sorted(f"{n}/{p.key}" for n, p in got if p.set == s) for s in ("train", *sets) if "/" not in s},
        "decision_points": {s: sum(len(y) for (_, p), st in got.items() if in_set(p, s)
                                   for qid, y in st.labels.items() if not p.teaches or qid in p.teaches)
                            for s in ("train", *sets)},
        "target_precision": args.target_precision, "fit_steps": steps, "tokens_extracted": tokens,
        "tokens_all_windows": sum(st.tokens for st in got.values()),  # this run's and --resume'd checkpoints
        "extract_minutes_all_windows": round(sum(st.seconds or 0.0 for st in got.values()) / 60, 2),
        "windows_untimed": sum(st.seconds is None for st in got.values()),  # checkpoints from before times were kept
        "minutes": round((time.perf_counter() - t0) / 60, 2), "extract_minutes": round(extract_s / 60, 2),
        "adapter_bytes": path.stat().st_size, "questions": report,
    }
    if args.method == "series":
        card["base_model_windows"] = args.base_model_windows if args.base_model else 0
        card["series"] = {"tap_layer": args.tap_layer, "lines": args.lines, "rank": args.series_rank,
                          "fit_orders": args.fit_orders, "choose": args.choose, "words": list(args.words),
                          "reduce": _reduce(args)}
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    return card
