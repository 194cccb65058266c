"""Shared fixtures: the tiny random Llama (no download), built once per test session."""

from __future__ import annotations

import os

import pytest

# Engine tests compare paths (entry vs cold, batched vs solo, restored vs live) within 1e-4:
# a statement about fp32, the reference. `auto` would pick bf16 on AMX/AVX512-BF16 machines;
# bf16 has its own tests (test_bf16.py, explicit dtypes). STREAMLLM_DTYPE=bfloat16 runs all in bf16.
os.environ.setdefault("STREAMLLM_DTYPE", "float32")

from streamllm.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Shared across tests: treat its tensors and tokenizer as read-only."""
    return load_model("tiny", progress=False)
