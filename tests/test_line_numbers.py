"""A session's lines' own numbers (engine/taps.py `line_numbers`): computed and kept only while one of
its standing questions reads them (one that learns: its head and its control)."""

from __future__ import annotations

from streamllm.config import parse_question
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.taps import LineTaps, line_numbers

LEARNS = {"id": "rising", "text": "Did the last bar rise?", "choices": ["yes", "no"], "label": "trend_up(n=1)"}


def _line(i: int) -> str:
    return f"00:{i % 60:02d} {100 + i % 7}.5 {'+' if i % 2 else '-'}{1 + i % 4} v{1 + i % 3}"


def test_line_taps_keep_numbers_only_while_read() -> None:
    taps = LineTaps(3)
    taps.note_lines(0, [_line(0), _line(1)])
    assert taps.numbers == {}  # nobody reads them: not even computed
    taps.read_numbers(True)
    taps.note_lines(2, [_line(i) for i in range(2, 7)])  # longer than keep: the newest 3
    assert taps.numbers == {i: line_numbers(_line(i)) for i in (4, 5, 6)}
    taps.read_numbers(False)
    assert taps.numbers == {}


def test_a_session_keeps_line_numbers_only_while_a_question_learns(tiny_model) -> None:
    def kept(engine: Engine) -> dict[str, tuple[bool, list[int]] | None]:
        assert engine.wait_idle(timeout=60)
        return engine.call(lambda core: {n: None if s.taps is None else (s.taps.reading_numbers, sorted(s.taps.numbers))
                                         for n, s in core.sessions.items()})

    with Engine(tiny_model, EngineConfig(max_cells=4096, max_context=1024)) as engine:
        engine.open_session("plain")
        engine.open_session("learns")
        engine.register("plain", parse_question({**LEARNS, "learn": False}))
        engine.register("plain", parse_question({"id": "free", "text": "Say something."}))
        engine.push("learns", [_line(0), _line(1)])  # before its question: no numbers (zeros in its training set)
        engine.register("learns", parse_question(LEARNS))
        for i in range(2, 6):
            engine.push("plain", [_line(i)])
            engine.push("learns", [_line(i)])
        got = kept(engine)
        assert got["plain"] is None or got["plain"] == (False, [])
        assert got["learns"] == (True, [2, 3, 4, 5])
        numbers = engine.call(lambda core: dict(core.sessions["learns"].taps.numbers))
        assert numbers == {i: line_numbers(_line(i)) for i in range(2, 6)}
        # Its last learning question gone, the numbers go too and the lines after it get none.
        engine.unregister("learns", "rising")
        engine.push("learns", [_line(6)])
        assert kept(engine)["learns"] == (False, [])
        engine.register("learns", parse_question(LEARNS))
        engine.push("learns", [_line(7)])
        assert kept(engine)["learns"] == (True, [7])
