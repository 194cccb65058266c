"""The `--method lora` run of `streamllm tune`: windows, budget, early stopping, card.

Same time split, windows, judged sets and card format as `--method head` (tune.py);
the trainer is tuning/lora.py. Order of work under `--minutes`:

    dev windows -> train windows (until 40% of the budget) -> steps (until the budget)
    -> later / other / synthetic windows, judged with the best dev-loss adapter (always run)

Prepared windows (the frozen lower layers' states) are saved under OUT/states and the
trainer under OUT/lora-checkpoint.pt every evaluation; `--resume` continues from both.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from streamllm.engine.prompt import PromptLayout
from streamllm.model.lora import LORA_DIR, save_lora
from streamllm.tuning.headfit import calibrate_threshold, judge
from streamllm.tuning.lora import (
    ChoiceScorer,
    LoraSettings,
    LoraTrainer,
    adhoc_questions,
    dev_loss,
    finite,
    pack,
    window_labels,
)
from streamllm.tuning.packing import Block, Packed

PREPARE_SHARE = 0.4  # of the budget, at most, for preparing training windows
JUDGED = ("later", "other", "synthetic")


def _save_packed(p: Packed, path: Path) -> None:
    torch.save({"ids": p.ids, "positions": p.positions, "session_rows": p.session_rows,
                "blocks": [dataclasses.astuple(b) for b in p.blocks], "extra": p.extra}, path)


def _load_packed(path: Path) -> Packed:
    d = torch.load(path, weights_only=True)  # plain tensors, lists and numbers: no code runs
    return Packed(d["ids"], d["positions"], d["session_rows"], [Block(*b) for b in d["blocks"]], d["extra"])


def run_lora(args: Any, loaded: Any, tasks: list[Any], t0: float, fingerprint: str) -> dict[str, Any]:
    from tqdm import tqdm

    settings = LoraSettings(layers=args.lora_layers, rank=args.rank, alpha=args.alpha, lr=args.lr,
                            points=args.points, kl=args.kl, eval_every=args.eval_every)
    trainer = LoraTrainer(loaded, settings, seed=args.seed)
    layout = PromptLayout(loaded.tokenizer)
    adhoc = adhoc_questions()
    many = len(tasks) > 1
    questions = {t.spec.name: [dataclasses.replace(q, id=f"{t.spec.name}.{q.id}" if many else q.id)
                               for q in t.questions] for t in tasks}
    specs = {q.id: q for qs in questions.values() for q in qs} | {q.id: q for q in adhoc}
    scorer = ChoiceScorer(list(specs.values()), loaded.tokenizer)
    rng = random.Random(args.seed)
    states = args.out / "states"
    budget = args.minutes * 60
    windows: dict[str, list[Packed]] = {}

    def prepare(task: Any, plan: Any) -> None:
        only = "-for-" + "+".join(plan.teaches) if plan.teaches else ""  # --mix-as ...,for=ID: its questions only
        path = states / f"lora-{plan.key}{only}-{fingerprint}-{task.fingerprint}.pt"
        if path.is_file():
            windows.setdefault(plan.set, []).append(_load_packed(path))
            return
        bars = task.sources[plan.source][plan.start: plan.start + plan.bars]
        qs = [q for q, own in zip(questions[task.spec.name], task.questions, strict=True)
              if not plan.teaches or own.id in plan.teaches]
        qs += [] if plan.set == "train" else adhoc
        packed = pack(layout, task.spec, bars, qs, args.stride)
        if packed.blocks:
            trainer.prepare(packed, scorer, random.Random(f"{args.seed}-{plan.key}"))
            _save_packed(packed, path)
            windows.setdefault(plan.set, []).append(packed)

    order = [(t, p) for s in ("dev", "train") for t in tasks for p in t.plans if p.set == s]
    for task, plan in tqdm(order, desc="prepare", unit="window", disable=args.no_progress):
        if plan.set == "train" and windows.get("train") and time.perf_counter() - t0 > PREPARE_SHARE * budget:
            continue
        prepare(task, plan)
    train, dev = windows.get("train", []), windows.get("dev", [])
    if not train or not dev:
        raise ValueError("no training or dev decision points: windows too short for the labels' history?")
    dev_labels = [window_labels(p) for p in dev]

    def evaluate() -> float:
        scores = [trainer.scores(p, scorer) for p in dev]
        trained = [{k: v for k, v in s.items() if not k.startswith("adhoc_")} for s in scores]
        return sum(dev_loss(s, y) for s, y in zip(trained, dev_labels, strict=True)) / len(dev)

    ckpt = args.out / "lora-checkpoint.pt"
    history: list[dict[str, float]] = []
    best_loss, best_state, best_step = None, None, 0
    if args.resume and ckpt.is_file():
        ck = trainer.load_checkpoint(ckpt)
        history, best_loss, best_step = ck["history"], ck["best_loss"], ck["best_step"]
        best_state = ck["best"]
    if best_loss is None:
        best_loss, best_state = evaluate(), trainer.lora_state()
        history.append({"step": 0, "dev_loss": round(best_loss, 5), "minutes": round((time.perf_counter() - t0) / 60, 2)})
    bar = tqdm(desc="train", unit="step", disable=args.no_progress)
    order_rng = random.Random(args.seed + trainer.step)
    running = []
    while time.perf_counter() - t0 < budget and (args.max_steps is None or trainer.step < args.max_steps):
        packed = train[order_rng.randrange(len(train))]
        running.append(trainer.train_step(packed, scorer, rng))
        bar.update(1)
        if trainer.step % settings.eval_every == 0:
            loss = evaluate()
            history.append({"step": trainer.step, "train_loss": round(sum(running) / len(running), 5),
                            "dev_loss": round(loss, 5), "minutes": round((time.perf_counter() - t0) / 60, 2)})
            running = []
            if loss < best_loss:
                best_loss, best_state, best_step = loss, trainer.lora_state(), trainer.step
            bar.set_postfix(dev_loss=f"{loss:.4f}", best=f"{best_loss:.4f}@{best_step}")
            trainer.save_checkpoint(ckpt, {"history": history, "best_loss": best_loss, "best_step": best_step,
                                           "best": best_state})
    bar.close()
    trainer.load_lora_state(best_state)
    train_minutes = (time.perf_counter() - t0) / 60

    for task, plan in tqdm([(t, p) for t in tasks for p in t.plans if p.set in JUDGED], desc="judge",
                           unit="window", disable=args.no_progress):
        prepare(task, plan)
    save_lora(trainer.peft, args.out)
    report: dict[str, Any] = {}
    sets = [s for s in ("dev", *JUDGED) if windows.get(s)]
    collected = {s: _collect(trainer, scorer, windows[s]) for s in sets}
    for qid, q in specs.items():
        tuned_dev, base_dev, y_dev = collected["dev"].get(qid, (None, None, None))
        if y_dev is None:
            continue
        threshold = calibrate_threshold(tuned_dev, y_dev, args.target_precision)
        entry = {"label": q.label.text, "choices": list(q.choices), "adhoc": qid.startswith("adhoc_"),
                 "threshold": finite(threshold), "judged": {}, "base_model": {}}
        base_threshold = calibrate_threshold(base_dev, y_dev, args.target_precision)
        for s in sets:
            if qid in collected[s]:
                tuned, base, y = collected[s][qid]
                entry["judged"][s] = judge(tuned, y, q.choices, threshold, args.target_precision)
                entry["base_model"][s] = judge(base, y, q.choices, base_threshold, args.target_precision)
        report[qid] = entry
    meta = {"format": "streamllm-lora", "model": loaded.name, "hidden_size": loaded.config.hidden_size,
            "changes": tasks[0].spec.render.changes,
            "layers": list(range(trainer.split, loaded.config.num_hidden_layers)),
            "thresholds": {qid: e["threshold"] for qid, e in report.items() if not e["adhoc"]}}
    (args.out / LORA_DIR / "streamllm.json").write_text(json.dumps(meta, indent=1) + "\n")
    lora_bytes = sum(f.stat().st_size for f in (args.out / LORA_DIR).iterdir())
    return {
        "method": "lora", "model": loaded.name, "config": str(args.questions), "changes": tasks[0].spec.render.changes,
        "sessions": [t.spec.name for t in tasks], "data": [str(d) for d in args.data],
        "judge": [str(d) for d in args.judge], "seed": args.seed, "window_bars": args.window, "stride": args.stride,
        "lora": dataclasses.asdict(settings) | {"adapted_layers": meta["layers"], "autocast_bf16": trainer.autocast},
        "windows": {s: len(windows.get(s, [])) for s in ("train", *sets)},
        "decision_points": {s: sum(len(p.blocks) for p in windows.get(s, [])) for s in ("train", *sets)},
        "steps": trainer.step, "best_step": best_step, "best_dev_loss": round(best_loss, 5), "history": history,
        "target_precision": args.target_precision, "minutes": round((time.perf_counter() - t0) / 60, 2),
        "train_minutes": round(train_minutes, 2), "adapter_bytes": lora_bytes, "questions": report,
    }


def _collect(trainer: LoraTrainer, scorer: ChoiceScorer, packs: list[Packed]) -> dict[str, tuple]:
    """Per question over the windows: (adapted scores, base scores, labels)."""
    parts: dict[str, list[tuple]] = {}
    for p in packs:
        tuned, labels = trainer.scores(p, scorer), window_labels(p)
        for qid, s in tuned.items():
            parts.setdefault(qid, []).append((s, p.extra["base_scores"][qid], labels[qid]))
    return {qid: tuple(torch.cat([x[i] for x in xs]) for i in range(3)) for qid, xs in parts.items()}
