"""Shared fixtures: the tiny random Llama (no download), built once per test session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest

# Engine tests compare paths (entry vs cold, batched vs solo, restored vs live) within 1e-4:
# a statement about fp32, the reference. `auto` would pick bf16 on AMX/AVX512-BF16 machines;
# bf16 has its own tests (test_bf16.py, explicit dtypes). STREAMLLM_DTYPE=bfloat16 runs all in bf16.
os.environ.setdefault("STREAMLLM_DTYPE", "float32")

from streamllm.model import LoadedModel, load_model


@pytest.fixture(scope="session", autouse=True)
def _tune_state_cache(tmp_path_factory):
    """`streamllm tune`'s shared state cache (tuning/cache.py) in a temporary folder, never the user's."""
    os.environ["STREAMLLM_STATES"] = str(tmp_path_factory.mktemp("tune-states"))


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Shared across tests: treat its tensors and tokenizer as read-only."""
    return load_model("tiny", progress=False)


@pytest.fixture
def spec(tmp_path):
    """The session of tests/test_tune.py's CONFIG (labelled choice questions over bars): tune, series, LoRA tests."""
    from streamllm.config import load_config
    from tests.test_tune import CONFIG

    (tmp_path / "q.toml").write_text(CONFIG)
    return load_config(tmp_path / "q.toml").sessions[0]


@pytest.fixture
def bars(tmp_path):
    """40 bars of tests/test_tune.py's random walk, as events."""
    from feeds.sources import TableSource
    from tests.test_tune import write_bars

    return TableSource(write_bars(tmp_path / "bars.csv", 40), "bar", instrument="TEST").events()


@contextlib.contextmanager
def serving_in_thread(server):
    """A StreamServer on its own event loop in a thread, so blocking clients can run in the test
    thread; closed (and its loop stopped) on exit."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="session")
def serve_in_thread():
    """serving_in_thread, for module-scoped server fixtures: `with serve_in_thread(server): ...`."""
    return serving_in_thread
