"""The state cache of `streamllm tune`: a window's extracted states, shared by every question and every run.

What a window's states depend on is its session's token ids (system prompt, rendered bars: the render
settings and the data fold into them, and so does the tokenizer), the model's weights and tokenizer,
the forward's dtype and device, and how the session is prefilled (chunk size). Its key is a hash of
exactly those; the questions are not in it. One entry holds, by name:

    lines.L{tap}.w{words}         every line's features at a tap layer (what series heads read: any question)
    points.{question}.hidden      decision-point hidden states of one question (its token ids' hash) after
    points.{question}.bars        the bars listed (method head; the base model's figures on the card)

Labels are never cached: they are the bars' (tuning/extract.window_labels), so a new question is new
labels over cached lines, then a fit. Fits are deterministic, so a series head's fit is kept too, keyed by
a hash of its exact samples and settings (tuning/fit.py): a run that changes one question fits one head.

    ROOT/<model>-<dtype>-<weights>/model.json          what the folder's states were made with
    ROOT/<model>-<dtype>-<weights>/window-<key>.safetensors, .json   one window; the .json says which
    ROOT/<model>-<dtype>-<weights>/fit-<key>.safetensors, .json      one series head's fit

ROOT is --cache-dir, else $STREAMLLM_STATES, else $STREAMLLM_HOME/states (~/.cache/streamllm/states).
An entry is written whole to a temporary file and renamed (a reader never sees half of one; of two
writers the last wins). Its metadata repeats its key and each tensor's hash: an entry that does not
read back, or whose key or hashes differ, is reported and extracted again, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from streamllm.model.checkpoint import streamllm_home

FORMAT = 1  # bump when what an entry holds, or how it is computed, changes


def default_root() -> Path:
    return Path(os.environ.get("STREAMLLM_STATES") or streamllm_home() / "states").expanduser()


def _digest(*parts: Any) -> str:
    return hashlib.blake2b(json.dumps(parts, separators=(",", ":")).encode(), digest_size=16).hexdigest()


def _tensor_hash(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    h.update(data.view(torch.uint8).numpy().data if data.numel() else b"")
    return h.hexdigest()


def model_fingerprint(loaded: Any) -> str:
    """A hash of the weights as loaded (an adapter merged at load is in them), the config and the tokenizer."""
    h = hashlib.blake2b(digest_size=16)
    h.update(loaded.config.to_json_string(use_diff=False).encode())
    vocab = sorted(loaded.tokenizer.get_vocab().items())
    h.update(json.dumps([vocab, getattr(loaded.tokenizer, "chat_template", None)]).encode())
    for name in sorted(loaded.state_dict):
        t = loaded.state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data)
    return h.hexdigest()


def samples_key(settings: dict[str, Any], *tensors: torch.Tensor) -> str:
    """A fit's key: its settings and the exact tensors it reads."""
    return _digest(settings, FORMAT, [_tensor_hash(t) for t in tensors])


def lines_name(tap_layer: int, words: Sequence[int | str]) -> str:
    return f"lines.L{tap_layer}.w{','.join(map(str, words))}"


def points_name(question_ids: Sequence[int]) -> str:
    return f"points.{_digest(list(question_ids))[:16]}"


class StateCache:
    """Windows' states under one model folder of ROOT, with hit and miss counts for the run's progress line."""

    def __init__(self, root: Path, loaded: Any, *, dtype: str, device: str, chunk_tokens: int) -> None:
        weights = model_fingerprint(loaded)
        # What the states depend on (the key's part); not the load's own notes (source: where, how long)
        self.model = {"model": loaded.name, "weights": weights, "dtype": dtype, "device": device,
                      "chunk_tokens": chunk_tokens, "format": FORMAT}
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(loaded.name)).name)[:40] or "model"
        self.dir = Path(root) / f"{stem}-{dtype}-{weights[:12]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        described = self.dir / "model.json"
        if not described.is_file():
            about = {**self.model, "source": str(loaded.source)}
            _write_atomic(described, (json.dumps(about, indent=1) + "\n").encode())
        self.hits = self.misses = self.partial = self.rejected = 0

    def key(self, ids: Sequence[int], ends: Sequence[int], prefix_len: int) -> str:
        return _digest(self.model, list(ids), list(ends), prefix_len)

    def path(self, key: str, kind: str = "window") -> Path:
        return self.dir / f"{kind}-{key[:24]}.safetensors"

    def read(self, key: str, kind: str = "window") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The entry's tensors and what it notes (a window: each part's [tokens, seconds]); empty when there
        is none, or when it does not check (then said on stderr, and the caller computes it again)."""
        path = self.path(key, kind)
        if not path.is_file():
            return {}, {}
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                info = json.loads((f.metadata() or {})["info"])
            tensors = load_file(str(path))
            if info.get("key") != key or info.get("format") != FORMAT:
                raise ValueError(f"it is another entry's (key {str(info.get('key'))[:24]}, format {info.get('format')})")
            sums = info["sha"]
            if set(sums) != set(tensors):
                raise ValueError(f"its tensors {sorted(tensors)} are not those its metadata lists")
            bad = [name for name, t in tensors.items() if _tensor_hash(t) != sums[name]]
            if bad:
                raise ValueError(f"{bad[0]} does not match its hash")
            return tensors, info["cost"]
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is extracted again, whatever broke it
            self.rejected += 1
            print(f"streamllm tune: warning: state cache entry {path} is corrupt or mismatched ({exc}); "
                  f"{'extracting' if kind == 'window' else 'computing'} it again", file=sys.stderr)
            return {}, {}

    def write(self, key: str, tensors: dict[str, torch.Tensor], cost: dict[str, Any], about: dict[str, Any],
              kind: str = "window") -> None:
        tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        info = {"key": key, "format": FORMAT, "sha": {name: _tensor_hash(t) for name, t in tensors.items()},
                "cost": cost}
        path = self.path(key, kind)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"info": json.dumps(info)})
        os.replace(tmp, path)
        about = {**about, "key": key, "parts": sorted(tensors), "written": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime())}
        _write_atomic(path.with_suffix(".json"), (json.dumps(about, indent=1) + "\n").encode())

    def summary(self) -> str:
        return (f"state cache {self.dir}: {self.hits} windows read, {self.partial} extended (questions' decision "
                f"points added), {self.misses} extracted" + (f", {self.rejected} rejected as corrupt or mismatched"
                                                            if self.rejected else ""))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
