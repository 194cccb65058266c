"""Model loading (HF dir, GGUF file, packaged default, tiny test model) and the forward."""

from __future__ import annotations

from streamllm.model.checkpoint import ModelError
from streamllm.model.loader import (
    LoadedModel,
    fetch_default,
    load_model,
    load_tokenizer,
    streamllm_home,
)

__all__ = [
    "LoadedModel",
    "ModelError",
    "fetch_default",
    "load_model",
    "load_tokenizer",
    "streamllm_home",
]
