"""Model loading (HF dir, GGUF file, packaged default, tiny test model) and the forward."""

from __future__ import annotations

from streamllm.model.loader import (
    LoadedModel,
    ModelError,
    cli_main,
    fetch_default,
    load_model,
    load_tokenizer,
    streamllm_home,
)

__all__ = [
    "LoadedModel",
    "ModelError",
    "cli_main",
    "fetch_default",
    "load_model",
    "load_tokenizer",
    "streamllm_home",
]
