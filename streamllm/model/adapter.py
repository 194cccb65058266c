"""Adapters made by `streamllm tune`: choice heads, read at decision points or over recent lines.

A head is a learned readout for one labelled choice question. Two kinds:

- entry (`--method head`): over the final normed hidden state h at the question's
  decision point (the pre-positioned entry's last row), choice logits = W h + b. It is
  the LM head's rows for the question's choices, re-trained.
- series (`--method series`): over the session's last K data lines. Per line the
  engine keeps f = [mean, last, the last token of each chosen word] of the residual
  stream at one layer over the line's tokens (engine/taps.py); the head projects each
  to z = P f + p (R numbers), and
  choice logits = sum over lines k of A[:, k] . [z_k, |z_k|] + b. The model reads the
  text; the head does the arithmetic across lines (sums, differences, magnitudes) that
  a small model's single decision-point state does not hold. A session's first lines
  (fewer than K since it began, at least the head's `min_lines`) are read with the
  newest lags only: the head was trained on window starts exactly so. A head learned live
  (engine/standing/learning.py) may also read each line's own numbers: `numbers` more
  columns after the line's features (the bare numbers the line writes, engine/taps.py).

Everything else in the model stays as it was: the KV cache, the fast path's scan and
the decode path are unchanged.

    adapter dir/
      head.safetensors   entry: {qid}.weight [C, H], {qid}.bias [C]; series: {qid}.proj [R, (2+W)H],
                         {qid}.proj_bias [R], {qid}.lags [C, K, 2R], {qid}.bias [C]; metadata "streamllm"
      card.json          what was trained on what, validation figures, thresholds
      card.md            the same for people
      lora/              or and: a LoRA from `tune --method lora` (peft's format, model/lora.py),
                         merged into the weights when the engine loads the model

A head applies to a registered question whose text (up to case and spaces) and
choices match the one it was trained on, in a session that writes its lines as the
tuned one did (`changes`: price units or basis points; `check_sessions` refuses
others); its gate threshold is the margin (best minus second-best choice logit)
calibrated by `tune` to the card's target precision.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import torch

from streamllm.config import normalize_question
from streamllm.model.errors import AdapterError
from streamllm.model.lora import has_lora, lora_digest, lora_meta
from streamllm.model.words import check_words

HEAD_FILE = "head.safetensors"
CARD_FILE = "card.json"
FORMAT = "streamllm-choice-heads"
FORMAT_VERSION = 6  # 2: series heads, 3: word features, 4: words by prefix, 5: min_lines, 6: numbers; older load


def _normalize(text: str) -> str:
    return normalize_question(text)


class HeadKind(StrEnum):
    """What a head reads: the decision point's hidden state (ENTRY) or the session's last lines (SERIES)."""

    ENTRY = "entry"
    SERIES = "series"


class _QuestionHead:
    """What every head kind shares: which registered question it answers."""

    __slots__ = ()
    text: str
    choices: tuple[str, ...]

    def matches(self, text: str, choices: tuple[str, ...]) -> bool:
        return _normalize(text) == _normalize(self.text) and tuple(choices) == self.choices


@dataclass(slots=True)
class ChoiceHead(_QuestionHead):
    """An entry head: reads the decision point's final normed hidden state."""

    kind: ClassVar[HeadKind] = HeadKind.ENTRY
    question_id: str
    text: str
    choices: tuple[str, ...]
    weight: torch.Tensor  # [C, H]
    bias: torch.Tensor  # [C]
    threshold: float  # margin at which the gate fires (inf: never reached the target precision)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Choice logits for a hidden state [H] (or a batch [N, H])."""
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> ChoiceHead:
        return ChoiceHead(self.question_id, self.text, self.choices, self.weight.to(device, dtype),
                          self.bias.to(device, dtype), self.threshold)


def series_width(hidden: int, words: int) -> int:
    """Numbers per line a series head reads (engine/taps.py): [mean, last] and each chosen word's last token."""
    return (2 + words) * hidden


def series_logits(lines: torch.Tensor, proj: torch.Tensor, proj_bias: torch.Tensor, lags: torch.Tensor,
                  bias: torch.Tensor) -> torch.Tensor:
    """Choice logits from line features [..., n, F] (oldest line first; n <= K: the newest n lags): [..., C].
    Training uses it too."""
    n, k = lines.shape[-2], lags.shape[1]
    if not 0 < n <= k:
        raise ValueError(f"a series head of {k} lines read {n}")
    z = lines @ proj.T + proj_bias  # [..., n, R]
    return torch.einsum("...kr,ckr->...c", torch.cat([z, z.abs()], -1), lags[:, k - n:]) + bias


@dataclass(slots=True)
class SeriesHead(_QuestionHead):
    """A series head: reads the session's last K lines' features at layer `layer` (engine/taps.py)."""

    kind: ClassVar[HeadKind] = HeadKind.SERIES
    question_id: str
    text: str
    choices: tuple[str, ...]
    layer: int  # the residual stream after this many layers (transformers' hidden_states[layer])
    proj: torch.Tensor  # [R, (2 + W) H], standardization folded in
    proj_bias: torch.Tensor  # [R]
    lags: torch.Tensor  # [C, K, 2R]
    bias: torch.Tensor  # [C]
    threshold: float
    words: tuple[int | str, ...] = ()  # the words whose last token each line's features add (engine/taps.py)
    min_lines: int = 0  # fewest lines of a session's start it was trained to read (0: K, whole windows only)
    numbers: int = 0  # columns of each line's own numbers after its features (0: the features alone)

    @property
    def lines(self) -> int:
        return int(self.lags.shape[1])

    def reads(self, upto: int) -> int:
        """Lines to read at a decision point after the session's first `upto` lines: K, or all of them
        while fewer than K exist and at least min_lines do (a session's start, as trained)."""
        return upto if self.min_lines and self.min_lines <= upto < self.lines else self.lines

    def logits(self, lines: torch.Tensor) -> torch.Tensor:
        """Choice logits for line features [K, F] (or a batch [N, K, F])."""
        return series_logits(lines.to(self.proj.dtype), self.proj, self.proj_bias, self.lags, self.bias)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> SeriesHead:
        return SeriesHead(self.question_id, self.text, self.choices, self.layer, self.proj.to(device, dtype),
                          self.proj_bias.to(device, dtype), self.lags.to(device, dtype), self.bias.to(device, dtype),
                          self.threshold, self.words, self.min_lines, self.numbers)


Head = ChoiceHead | SeriesHead


@dataclass(slots=True)
class Adapter:
    path: Path
    id: str  # content hash of head.safetensors: snapshots record it
    model: str  # the model the heads were trained on
    hidden_size: int
    heads: list[Head]
    lora: bool = False  # a lora/ to merge into the weights at load (model/lora.py)
    changes: str = "price"  # the bar lines it was tuned on: [sessions.render] changes (feeding/render.py)

    def head_for(self, text: str, choices: tuple[str, ...]) -> Head | None:
        return next((h for h in self.heads if h.matches(text, choices)), None)

    @property
    def tap_layer(self) -> int | None:
        """The layer the series heads read (one per adapter), None without series heads."""
        layers = {h.layer for h in self.heads if h.kind == HeadKind.SERIES}
        return layers.pop() if layers else None

    @property
    def tap_words(self) -> tuple[int | str, ...]:
        """The words whose last token the series heads' line features add (one set per adapter)."""
        words = {h.words for h in self.heads if h.kind == HeadKind.SERIES}
        return words.pop() if words else ()

    @property
    def tap_lines(self) -> int:
        """Lines of features a session must keep for the longest series head (0: none)."""
        return max((h.lines for h in self.heads if h.kind == HeadKind.SERIES), default=0)


def save_heads(directory: str | Path, heads: list[Head], *, model: str, changes: str = "price") -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not heads:
        raise AdapterError("no heads to save")
    tensors: dict[str, torch.Tensor] = {}
    questions = []
    if len({(h.layer, h.words) for h in heads if h.kind == HeadKind.SERIES}) > 1:
        raise AdapterError("series heads of one adapter must read one layer and words (the engine taps one)")
    for h in heads:
        if h.kind == HeadKind.SERIES:
            _checked_words(directory, h.question_id, list(h.words))
        names = ("weight", "bias") if h.kind == HeadKind.ENTRY else ("proj", "proj_bias", "lags", "bias")
        for name in names:
            tensors[f"{h.question_id}.{name}"] = getattr(h, name).detach().float().contiguous().cpu()
        q = {"id": h.question_id, "kind": h.kind, "text": h.text, "choices": list(h.choices),
             "threshold": h.threshold if math.isfinite(h.threshold) else None}
        if h.kind == HeadKind.SERIES:
            q["layer"], q["words"] = h.layer, list(h.words)
            if h.min_lines:
                q["min_lines"] = h.min_lines
            if h.numbers:
                q["numbers"] = h.numbers
        questions.append(q)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model,
            "hidden_size": _hidden_of(heads[0]), "changes": changes, "questions": questions}
    path = directory / HEAD_FILE
    save_file(tensors, str(path), metadata={"streamllm": json.dumps(meta)})
    return path


def _checked_words(where: Path, question_id: str, words: Any) -> tuple[int | str, ...]:
    try:
        if not isinstance(words, list):
            raise ValueError("not a list")
        return check_words(words)
    except ValueError:
        raise AdapterError(f"adapter {where}: question {question_id!r} has bad words {words!r}") from None


def _hidden_of(head: Head) -> int:
    if head.kind == HeadKind.ENTRY:
        return int(head.weight.shape[1])
    return (int(head.proj.shape[1]) - head.numbers) // series_width(1, len(head.words))


def load_adapter(directory: str | Path) -> Adapter:
    directory = Path(directory)
    path = directory / HEAD_FILE
    lora = has_lora(directory)
    if not path.is_file() and not lora:
        raise AdapterError(f"adapter {directory}: no {HEAD_FILE} and no lora/ (make one with `streamllm tune`)")
    heads, model, hidden, digest, changes = [], None, None, "", "price"
    if path.is_file():
        model, hidden, heads, changes = _read_heads(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    if lora:
        meta = lora_meta(directory)
        if model is not None and (meta.get("model"), meta.get("hidden_size")) != (model, hidden):
            raise AdapterError(f"adapter {directory}: its heads and its LoRA were trained on different models")
        lora_changes = meta.get("changes", "price")  # files from before the option: price units
        if model is not None and lora_changes != changes:
            raise AdapterError(f"adapter {directory}: its heads and its LoRA were tuned on different lines")
        model, hidden, changes = str(meta.get("model")), int(meta["hidden_size"]), lora_changes
        digest = hashlib.sha256((digest + lora_digest(directory)).encode()).hexdigest()[:16]
    return Adapter(directory, digest, model, hidden, heads, lora, changes)


def _read_heads(path: Path) -> tuple[str, int, list[Head], str]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["streamllm"])
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {path}: not a readable head file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") not in range(1, FORMAT_VERSION + 1):
        raise AdapterError(f"adapter {path}: format {meta.get('format')!r} v{meta.get('format_version')!r}, "
                           f"this build reads {FORMAT} v1-v{FORMAT_VERSION}")
    hidden = int(meta["hidden_size"])
    heads: list[Head] = []
    for q in meta["questions"]:
        heads.append(_read_head(path, q, tensors, hidden))
    if len({(h.layer, h.words) for h in heads if h.kind == HeadKind.SERIES}) > 1:
        raise AdapterError(f"adapter {path}: its series heads read different layers or words")
    changes = meta.get("changes", "price")  # files from before the option: price units
    if changes not in ("price", "bp"):
        raise AdapterError(f"adapter {path}: unknown line units {changes!r}")
    return str(meta.get("model")), hidden, heads, changes


def _read_head(path: Path, q: dict[str, Any], tensors: dict[str, torch.Tensor], hidden: int) -> Head:
    kind, c = q.get("kind", HeadKind.ENTRY), len(q["choices"])
    threshold = math.inf if q["threshold"] is None else float(q["threshold"])
    got = {name: tensors.get(f"{q['id']}.{name}") for name in ("weight", "bias", "proj", "proj_bias", "lags")}

    def shaped(name: str, *dims: int | None) -> bool:
        t = got[name]
        return t is not None and t.dim() == len(dims) and all(d is None or d == n for d, n in zip(dims, t.shape, strict=True))

    if kind == HeadKind.ENTRY and shaped("weight", c, hidden) and shaped("bias", c):
        return ChoiceHead(q["id"], q["text"], tuple(q["choices"]), got["weight"], got["bias"], threshold)
    words = _checked_words(path, q["id"], q.get("words", []))
    numbers = q.get("numbers", 0)
    if not isinstance(numbers, int) or numbers < 0:
        raise AdapterError(f"adapter {path}: question {q['id']!r} reads {numbers!r} numbers per line")
    if kind == HeadKind.SERIES and shaped("proj", None, series_width(hidden, len(words)) + numbers) and shaped("bias", c):
        r = got["proj"].shape[0]
        least = q.get("min_lines", 0)
        if (shaped("proj_bias", r) and shaped("lags", c, None, 2 * r) and isinstance(q.get("layer"), int)
                and isinstance(least, int) and 0 <= least <= got["lags"].shape[1]):
            return SeriesHead(q["id"], q["text"], tuple(q["choices"]), q["layer"], got["proj"], got["proj_bias"],
                              got["lags"], got["bias"], threshold, words, least, numbers)
    if kind not in tuple(HeadKind):
        raise AdapterError(f"adapter {path}: question {q['id']!r} has an unknown head kind {kind!r}")
    raise AdapterError(f"adapter {path}: question {q['id']!r} has missing or misshapen tensors")


def check_adapter(adapter: Adapter, model_name: str, hidden_size: int, num_layers: int | None = None) -> None:
    """The heads read this model's hidden states: refuse another model's adapter."""
    if adapter.hidden_size != hidden_size or adapter.model != model_name:
        raise AdapterError(f"adapter {adapter.path} was trained on {adapter.model!r} (hidden {adapter.hidden_size}); "
                           f"this engine runs {model_name!r} (hidden {hidden_size})")
    layer = adapter.tap_layer
    if layer is not None and num_layers is not None and not 0 <= layer <= num_layers:
        raise AdapterError(f"adapter {adapter.path}: series heads read layer {layer}; the model has {num_layers}")


def check_sessions(adapter: Adapter, sessions: Any, source: Any = "config") -> None:
    """Refuse a session whose bar lines are not the ones the adapter was tuned on: a head reading
    basis points where it learned price units answers confidently and wrong."""
    for i, spec in enumerate(sessions):
        tuned = adapter.lora or any(adapter.head_for(q.text, q.choices) for q in spec.questions if q.choices)
        if tuned and spec.render.mode == "bars" and spec.render.changes != adapter.changes:
            raise AdapterError(f"{source}: sessions[{i}].render.changes: session {spec.name!r} writes "
                               f"{spec.render.changes!r} lines; adapter {adapter.path} was tuned on "
                               f"{adapter.changes!r} lines. Re-run `streamllm tune` on this config, or set "
                               f"changes = {adapter.changes!r}")


def card(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CARD_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def pick_adapter(explicit: str | Path | None, from_config: Path | None, model_name: str, warn=print,
                 config: Any = None) -> Adapter | None:
    """The adapter a command runs with: `--adapter` (must fit the model), else the config's
    `[model] adapter` when it was trained on this model (another model runs without it, with a warning).
    Either must have been tuned on the lines the config's sessions write (`check_sessions`)."""
    if explicit is not None:
        adapter = load_adapter(explicit)
    elif from_config is None:
        return None
    else:
        adapter = load_adapter(from_config)
        if adapter.model != model_name:
            warn(f"adapter {from_config} was trained on {adapter.model!r}, not {model_name!r}: running without it")
            return None
    if config is not None:
        check_sessions(adapter, config.sessions, config.source)
    return adapter
