"""Adapters made by `streamllm tune`: choice heads read at decision points.

A head is a learned readout for one labelled choice question: over the final normed
hidden state h at the question's decision point (the pre-positioned entry's last
row), choice logits = W h + b, one row per choice. It is the LM head's rows for the
question's choices, re-trained; everything else in the model stays as it was, so the
KV cache, the fast path's scan and the decode path are unchanged.

    adapter dir/
      head.safetensors   {qid}.weight [choices, hidden], {qid}.bias [choices]; metadata "streamllm"
      card.json          what was trained on what, validation figures, thresholds
      card.md            the same for people
      lora/              or and: a LoRA from `tune --method lora` (peft's format, model/lora.py),
                         merged into the weights when the engine loads the model

A head applies to a registered question whose text (up to case and spaces) and
choices match the one it was trained on; its gate threshold is the margin (best minus
second-best choice logit) calibrated by `tune` to the card's target precision.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HEAD_FILE = "head.safetensors"
CARD_FILE = "card.json"
FORMAT = "streamllm-choice-heads"
FORMAT_VERSION = 1


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded (missing, corrupt, or for another model)."""


def _normalize(text: str) -> str:
    from streamllm.config import normalize_question

    return normalize_question(text)


@dataclass(slots=True)
class ChoiceHead:
    question_id: str
    text: str
    choices: tuple[str, ...]
    weight: torch.Tensor  # [C, H]
    bias: torch.Tensor  # [C]
    threshold: float  # margin at which the gate fires (inf: never reached the target precision)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Choice logits for a hidden state [H] (or a batch [N, H])."""
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)

    def matches(self, text: str, choices: tuple[str, ...]) -> bool:
        return _normalize(text) == _normalize(self.text) and tuple(choices) == self.choices

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> ChoiceHead:
        return ChoiceHead(self.question_id, self.text, self.choices, self.weight.to(device, dtype),
                          self.bias.to(device, dtype), self.threshold)


@dataclass(slots=True)
class Adapter:
    path: Path
    id: str  # content hash of head.safetensors: snapshots record it
    model: str  # the model the heads were trained on
    hidden_size: int
    heads: list[ChoiceHead]
    lora: bool = False  # a lora/ to merge into the weights at load (model/lora.py)

    def head_for(self, text: str, choices: tuple[str, ...]) -> ChoiceHead | None:
        return next((h for h in self.heads if h.matches(text, choices)), None)


def save_heads(directory: str | Path, heads: list[ChoiceHead], *, model: str) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not heads:
        raise AdapterError("no heads to save")
    tensors: dict[str, torch.Tensor] = {}
    questions = []
    for h in heads:
        tensors[f"{h.question_id}.weight"] = h.weight.detach().float().contiguous().cpu()
        tensors[f"{h.question_id}.bias"] = h.bias.detach().float().contiguous().cpu()
        questions.append({"id": h.question_id, "text": h.text, "choices": list(h.choices),
                          "threshold": h.threshold if math.isfinite(h.threshold) else None})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model,
            "hidden_size": int(heads[0].weight.shape[1]), "questions": questions}
    path = directory / HEAD_FILE
    save_file(tensors, str(path), metadata={"streamllm": json.dumps(meta)})
    return path


def load_adapter(directory: str | Path) -> Adapter:
    from streamllm.model.lora import has_lora, lora_digest, lora_meta

    directory = Path(directory)
    path = directory / HEAD_FILE
    lora = has_lora(directory)
    if not path.is_file() and not lora:
        raise AdapterError(f"adapter {directory}: no {HEAD_FILE} and no lora/ (make one with `streamllm tune`)")
    heads, model, hidden, digest = [], None, None, ""
    if path.is_file():
        model, hidden, heads = _read_heads(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    if lora:
        meta = lora_meta(directory)
        if model is not None and (meta.get("model"), meta.get("hidden_size")) != (model, hidden):
            raise AdapterError(f"adapter {directory}: its heads and its LoRA were trained on different models")
        model, hidden = str(meta.get("model")), int(meta["hidden_size"])
        digest = hashlib.sha256((digest + lora_digest(directory)).encode()).hexdigest()[:16]
    return Adapter(directory, digest, model, hidden, heads, lora)


def _read_heads(path: Path) -> tuple[str, int, list[ChoiceHead]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["streamllm"])
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {path}: not a readable head file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise AdapterError(f"adapter {path}: format {meta.get('format')!r} v{meta.get('format_version')!r}, "
                           f"this build reads {FORMAT} v{FORMAT_VERSION}")
    heads = []
    for q in meta["questions"]:
        weight, bias = tensors.get(f"{q['id']}.weight"), tensors.get(f"{q['id']}.bias")
        if weight is None or bias is None or weight.shape != (len(q["choices"]), meta["hidden_size"]) \
                or bias.shape != (len(q["choices"]),):
            raise AdapterError(f"adapter {path}: question {q['id']!r} has missing or misshapen tensors")
        threshold = math.inf if q["threshold"] is None else float(q["threshold"])
        heads.append(ChoiceHead(q["id"], q["text"], tuple(q["choices"]), weight, bias, threshold))
    return str(meta.get("model")), int(meta["hidden_size"]), heads


def check_adapter(adapter: Adapter, model_name: str, hidden_size: int) -> None:
    """The heads read this model's hidden states: refuse another model's adapter."""
    if adapter.hidden_size != hidden_size or adapter.model != model_name:
        raise AdapterError(f"adapter {adapter.path} was trained on {adapter.model!r} (hidden {adapter.hidden_size}); "
                           f"this engine runs {model_name!r} (hidden {hidden_size})")


def card(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CARD_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def pick_adapter(explicit: str | Path | None, from_config: Path | None, model_name: str, warn=print) -> Adapter | None:
    """The adapter a command runs with: `--adapter` (must fit the model), else the config's
    `[model] adapter` when it was trained on this model (another model runs without it, with a warning)."""
    if explicit is not None:
        return load_adapter(explicit)
    if from_config is None:
        return None
    adapter = load_adapter(from_config)
    if adapter.model != model_name:
        warn(f"adapter {from_config} was trained on {adapter.model!r}, not {model_name!r}: running without it")
        return None
    return adapter
