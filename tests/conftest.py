"""Shared fixtures: the tiny random Llama (no download), built once per test session."""

from __future__ import annotations

import pytest

from streamllm.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Shared across tests: treat its tensors and tokenizer as read-only."""
    return load_model("tiny", progress=False)
