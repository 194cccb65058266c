"""What a user sees of a standing answer before it can be one (#47): warming up (no data yet, a label
whose history the session does not hold yet), and which threshold the gate decided at (config, head, auto)."""

from __future__ import annotations

import math

import pytest

from streamllm.config import QuestionSpec
from streamllm.config.labels import parse_label
from streamllm.engine import Engine, EngineConfig, SchedulerConfig
from streamllm.engine.standing.gate import Gate
from streamllm.engine.standing.prepos import threshold_in_force
from tests.test_prepos import LINES


@pytest.fixture()
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=2048,
                                          scheduler=SchedulerConfig(chunk_tokens=24, step_tokens=64)))
    yield eng
    eng.shutdown()


def test_a_labelled_answer_warms_up_until_the_session_holds_the_labels_history(engine):
    spec = QuestionSpec("trend", "Up or down?", choices=("up", "down"), threshold=0.5,
                        label=parse_label("trend_up(n=4)"))
    engine.open_session("s")
    engine.register("s", spec)
    engine.wait_idle()
    (first,) = engine.standing("s")
    assert first.data_version == 0 and first.warming_up and first.warming_up_reason == "no data yet (data_version 0)"
    heard = []
    engine.subscribe("s", heard.append)
    for line in LINES[:2]:  # one line per version
        engine.push("s", [line])
    engine.wait_idle()
    (early,) = engine.standing("s")
    assert early.data_version == 2 and early.warming_up
    assert early.warming_up_reason == "its label trend_up(n=4) looks back 4 bars; the session has 2 so far"
    assert engine.ask("s", "trend").warming_up  # an ask answered from the same guess says so too
    for line in LINES[2:6]:
        engine.push("s", [line])
    engine.wait_idle()
    (later,) = engine.standing("s")
    assert later.data_version == 6 and not later.warming_up and later.warming_up_reason is None
    assert (later.threshold, later.threshold_source) == (0.5, "config")
    assert not engine.ask("s", "trend").warming_up
    # subscribers hear the answer stop being a guess, even when its text stayed the same
    assert heard and not heard[-1].warming_up and heard[-1].data_version > 2
    assert later.to_dict()["warming_up"] is False


def test_an_unlabelled_answer_warms_up_only_at_data_version_0(engine):
    engine.open_session("s")
    engine.register("s", QuestionSpec("q", "What next?", threshold=3.0, max_tokens=2))
    engine.push("s", LINES[:1])
    engine.wait_idle()
    (answer,) = engine.standing("s")
    assert answer.data_version == 1 and not answer.warming_up


class _Head:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold


def test_threshold_in_force_names_whose_it_is():
    gate = Gate("q", 2.0, ("up", "down"), None, (), (), None)
    assert threshold_in_force(gate, "up", head_read=False) == (2.0, "config")
    gate.head = _Head(math.inf)  # a head whose calibration never reached its target: closed
    assert threshold_in_force(gate, "up", head_read=True) == (None, "head")
    assert threshold_in_force(gate, "up", head_read=False) == (2.0, "config")  # the head could not read yet
    gate.head = _Head(0.7)
    assert threshold_in_force(gate, "down", head_read=True) == (0.7, "head")
    gate.auto, gate.choice_thresholds = True, {"up": 1.5}
    assert threshold_in_force(gate, "Up", head_read=True) == (1.5, "auto")
    assert threshold_in_force(gate, "down", head_read=True) == (None, "auto")  # no evidence for it yet


def test_stats_say_which_threshold_is_in_force(engine, serve_in_thread):
    from streamllm.client.client import Client
    from streamllm.service.server import ServerConfig, StreamServer

    with serve_in_thread(StreamServer(engine, config=ServerConfig(port=0))) as server, Client(server.url) as client:
        client.open("s")
        client.register("s", {"id": "trend", "text": "Up or down?", "choices": ["up", "down"], "threshold": 2.0})
        client.register("s", {"id": "next", "text": "What next?", "threshold": 1e9, "max_tokens": 2})
        ack = client.push("s", LINES[:3])
        reply = client.ask("s", "trend", min_version=ack["data_version"])
        assert reply["warming_up"] is False and reply["warming_up_reason"] is None
        engine.wait_idle()
        (mine,) = client.stats()["sessions"]
        assert mine["thresholds"] == {"trend": {"threshold": 2.0, "source": "config"},
                                      "next": {"threshold": 1e9, "source": "config"}}


def test_a_series_head_warms_up_until_it_has_lines_to_read_and_then_its_threshold_is_in_force(
        tiny_model, spec, bars, tmp_path):
    """Before a series head holds the lines it reads, the LM alone decides, at the config's threshold:
    a guess, said so. Then the head's own threshold replaces the config's, and the answer says whose."""
    from streamllm.model.adapter import save_heads
    from streamllm.tuning.extract import render_window
    from tests.test_tune import LINES as HEAD_LINES
    from tests.test_tune import engine_with, random_series

    heads = random_series(spec, tiny_model.config.hidden_size, threshold=0.25)
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    trend = spec.questions[0]  # label trend_up(n=5), a head of 6 lines
    eng = engine_with(tiny_model, tmp_path / "ad")
    try:
        eng.open_session("test", system=spec.system_prompt)
        eng.register("test", trend)
        seen = []
        for line in render_window(bars[:8]):
            eng.push("test", [line])
            assert eng.wait_idle()
            (answer,) = eng.standing("test")
            seen.append((answer.warming_up_reason, answer.threshold, answer.threshold_source))
    finally:
        eng.shutdown()
    early = [(f"its head needs {HEAD_LINES} lines; the session has {n} so far", trend.threshold, "config")
             for n in range(1, HEAD_LINES)]
    assert seen == [*early, *[(None, 0.25, "head")] * (8 - HEAD_LINES + 1)]
