"""`streamllm tune --from-live SNAPSHOT... --out DIR`: the heads questions learned live, as an adapter.

A snapshot (`streamllm sessions snapshot`, an eviction, a checkpoint) carries what each learning
question has learned (engine/standing/learning.py: `learned/<question>/...` tensors, `meta["learned"]`).
This reads those files alone (no model, no engine) and writes the heads into an adapter folder
that `serve --adapter DIR`, `[adapter]` in a config, or `Engine(adapter=...)` load like a tuned
one, so what a server learned outlives the server and can be shipped. One head per question id:
a question learned in several snapshots keeps the one trained on the most samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from streamllm.model.adapter import CARD_FILE, SeriesHead, save_heads
from streamllm.tuning.data import TuneError

HEAD_TENSORS = ("proj", "proj_bias", "lags", "bias")


def _read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["streamllm"])
            learned = {key: fh.get_tensor(key) for key in fh.keys() if key.startswith("learned/")}  # noqa: SIM118
    except (OSError, SafetensorError, KeyError, json.JSONDecodeError) as exc:
        raise TuneError(f"--from-live {path}: not a streamllm snapshot ({exc})") from None
    return meta, learned


def heads_from_snapshots(paths: list[Path]) -> tuple[list[SeriesHead], str, dict[str, dict[str, Any]]]:
    """(learned heads, the model they read, per question: where it came from and its learning figures)."""
    best: dict[str, tuple[int, SeriesHead, dict[str, Any]]] = {}
    models = set()
    for path in paths:
        meta, tensors = _read(path)
        models.add(str(meta.get("model")))
        questions = {q["id"]: q for q in meta.get("questions", [])}
        for qid, state in (meta.get("learned") or {}).items():
            head = state.get("head")
            if head is None or qid not in questions:
                continue  # still learning: no head yet
            q = questions[qid]
            try:
                parts = {name: tensors[f"learned/{qid}/{name}"] for name in HEAD_TENSORS}
                made = SeriesHead(qid, q["text"], tuple(q["choices"]), int(head["layer"]), parts["proj"],
                                  parts["proj_bias"], parts["lags"], parts["bias"], float(head["threshold"]),
                                  tuple(head["words"]), int(head["min_lines"]), int(head.get("numbers", 0)))
            except (KeyError, TypeError, ValueError) as exc:
                raise TuneError(f"--from-live {path}: question {qid!r}: learned head malformed ({exc})") from None
            samples = len(state.get("samples", []))
            if qid not in best or samples > best[qid][0]:
                best[qid] = (samples, made, {"snapshot": str(path), "session": meta.get("session"),
                                             "fits": state.get("fits"), "samples": samples,
                                             "trained_upto": state.get("trained_upto"),
                                             "label": q.get("label")})
    if len(models) > 1:
        raise TuneError(f"--from-live: the snapshots were written by different models {sorted(models)}")
    if not best:
        raise TuneError("--from-live: no learned head in " + ", ".join(map(str, paths))
                        + " (a question learns one after its first fit: docs/calibration.md)")
    return [h for _, h, _ in best.values()], models.pop(), {q: info for q, (_, _, info) in best.items()}


def export_live(paths: list[Path], out: Path, changes: str = "price") -> dict[str, Any]:
    """Write the learned heads of `paths` to adapter folder `out`; returns its card."""
    heads, model, sources = heads_from_snapshots(paths)
    save_heads(out, heads, model=model, changes=changes)
    card = {"method": "live", "model": model, "changes": changes, "questions": sources}
    (out / CARD_FILE).write_text(json.dumps(card, indent=1))
    return card
