"""streamllm tune's state cache (streamllm/tuning/cache.py) on the tiny model: what hits, what misses,
what a corrupt entry does."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re

import torch
from safetensors.torch import load_file

from streamllm.cli.tune import main as cli_main
from streamllm.config.labels import parse_label
from streamllm.model import LoadedModel
from streamllm.model.adapter import load_adapter
from streamllm.tuning.cache import StateCache, lines_name
from streamllm.tuning.data import Task, WindowPlan
from streamllm.tuning.extract import CHUNK_TOKENS, StateExtractor, render_window, window_labels
from streamllm.tuning.tune import _window_states
from tests.test_tune import CONFIG, write_bars

LAYER, WORDS = 1, (2, "v")
NEW_QUESTION = """
[[sessions.questions]]
id = "ema"
text = "Is the last close above its 5-bar average?"
choices = ["yes", "no"]
label = "close > sma(close, 5)"
"""


def _states(model, spec, bars, root, *, method="series", base_model=False, dtype="float32"):
    """One window's states through tune's own path: (WindowStates, tokens computed, the cache)."""
    questions = [q for q in spec.questions if q.label is not None and q.choices]
    extractor = StateExtractor(model, spec, questions, tap_layer=LAYER if method == "series" else None,
                               words=WORDS if method == "series" else (), dtype=dtype)
    cache = StateCache(root, model, dtype=extractor.model.dtype_choice.name, device=str(extractor.model.device),
                       chunk_tokens=CHUNK_TOKENS)
    plan = WindowPlan("dev", "bars", 0, len(bars))
    task = Task(spec, questions, {"bars": list(bars)}, [plan])
    task.extractor = extractor
    args = argparse.Namespace(method=method, stride=4, tap_layer=LAYER, words=WORDS, base_model=base_model)
    states, computed, _ = _window_states(task, plan, args, cache, extract=True, pointed=method == "head")
    return states, computed, cache


def test_the_same_window_is_read_back_bit_for_bit_and_other_settings_miss(tiny_model, spec, bars, tmp_path):
    first, computed, cache = _states(tiny_model, spec, bars[:24], tmp_path)
    assert computed > 0 and cache.misses == 1
    fresh = StateExtractor(tiny_model, spec, [q for q in spec.questions if q.label is not None],
                           tap_layer=LAYER, words=WORDS).extract(bars[:24], stride=4)
    assert torch.equal(first.lines, fresh.lines)  # what the cache holds is what extraction gives
    # the same weights loaded again (the load's notes differ: how long it took) read it back
    reloaded = dataclasses.replace(tiny_model, source=f"{tiny_model.source}; loaded in 9.99s")
    again, computed, cache = _states(reloaded, spec, bars[:24], tmp_path)
    assert computed == 0 and cache.hits == 1 and cache.misses == 0
    assert torch.equal(again.lines, first.lines)
    for qid, labels in first.line_labels.items():
        assert torch.equal(again.line_labels[qid], labels)
    # Whatever the session's tokens or the forward depend on is a miss: render settings, the prompt,
    # the window's bars, the weights, the dtype.
    bp = dataclasses.replace(spec, render=dataclasses.replace(spec.render, changes="bp"))
    prompt = dataclasses.replace(spec, system_prompt="You read bars.")
    other = dict(tiny_model.state_dict)
    name = next(n for n in other if n.endswith("mlp.down_proj.weight"))
    other[name] = other[name] + 1e-3
    changed = LoadedModel(tiny_model.name, tiny_model.config, other, tiny_model.tokenizer, tiny_model.source)
    for case in ({"spec": bp}, {"spec": prompt}, {"bars": bars[1:25]}, {"model": changed}, {"dtype": "bfloat16"}):
        kw = {"model": tiny_model, "spec": spec, "bars": bars[:24]} | case
        _, computed, cache = _states(kw.pop("model"), kw.pop("spec"), kw.pop("bars"), tmp_path, **kw)
        assert computed > 0 and cache.misses == 1, case


def test_a_corrupt_or_mismatched_entry_is_extracted_again(tiny_model, spec, bars, tmp_path, capsys):
    first, _, cache = _states(tiny_model, spec, bars[:24], tmp_path)
    (path,) = cache.dir.glob("window-*.safetensors")
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[-100] ^= 0x40  # one bit of a tensor's data: still a readable file
    for bad in (bytes(flipped), good[: len(good) // 2]):
        path.write_bytes(bad)
        states, computed, cache = _states(tiny_model, spec, bars[:24], tmp_path)
        assert computed > 0 and cache.rejected == 1 and cache.hits == 0
        assert "corrupt or mismatched" in capsys.readouterr().err
        assert torch.equal(states.lines, first.lines)
        assert torch.equal(load_file(str(path))[lines_name(LAYER, WORDS)], first.lines)  # rewritten whole
        assert _states(tiny_model, spec, bars[:24], tmp_path)[1] == 0
    # Another window's entry under this one's name: its key is checked, not only its file name.
    _states(tiny_model, spec, bars[10:34], tmp_path)
    other = next(p for p in cache.dir.glob("window-*.safetensors") if p != path)
    path.write_bytes(other.read_bytes())
    _, computed, cache = _states(tiny_model, spec, bars[:24], tmp_path)
    assert computed > 0 and cache.rejected == 1 and "another entry's" in capsys.readouterr().err


def test_a_new_question_adds_its_decision_points_to_the_cached_window(tiny_model, spec, bars, tmp_path):
    """method head: the questions' decision points are cached by question text; one more question
    branches only itself, and the others' states are read back unchanged."""
    first, computed, cache = _states(tiny_model, spec, bars[:24], tmp_path, method="head")
    assert computed > 0 and first.lines is None and set(first.features) == {"trend", "sma"}
    assert first.bars["trend"].tolist() == [7, 11, 15, 19, 23] and first.bars["sma"].tolist() == [7, 11, 15, 19, 23]
    wider = dataclasses.replace(spec, questions=(*spec.questions, dataclasses.replace(
        spec.questions[1], id="again", text="Is the close above its 8-bar average?")))
    states, computed, cache = _states(tiny_model, wider, bars[:24], tmp_path, method="head")
    assert cache.partial == 1 and cache.misses == 0
    ex = StateExtractor(tiny_model, wider, [q for q in wider.questions if q.label is not None])
    session = len(ex.session_ids(render_window(bars[:24]))[0])
    assert computed == session + 5 * len(ex.question_ids["again"])  # the session, the new question's branches
    for qid in ("trend", "sma"):
        assert torch.equal(states.features[qid], first.features[qid])
    assert states.features["again"].shape == first.features["sma"].shape


def _summary(err: str) -> tuple[int, int, int]:
    read, extended, extracted = re.search(r"(\d+) windows read, (\d+) extended .*?, (\d+) extracted", err).groups()
    return int(read), int(extended), int(extracted)


def test_a_second_tune_with_another_question_extracts_nothing(tiny_model, tmp_path, monkeypatch, capsys):
    import streamllm.model.loader as loader
    import streamllm.tuning.fit as fit

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    # The real fit, shorter: what is under test is where its states come from.
    monkeypatch.setattr(fit, "fit_series", functools.partial(fit.fit_series, steps=40, grid=(1e-2,)))
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text(CONFIG)
    second.write_text(CONFIG + NEW_QUESTION)
    data = write_bars(tmp_path / "bars.csv", 300)
    argv = ["--data", str(data), "--model", "tiny", "--tap-layer", str(LAYER), "--lines", "8", "--window", "24",
            "--stride", "8", "--train-windows", "2", "--dev-windows", "1", "--later-windows", "1",
            "--synthetic-bars", "0", "--no-progress", "--fit-orders", "1", "--words", "", "--target-precision", "0.8",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli_main([*argv, "--questions", str(first), "--out", str(tmp_path / "a")]) == 0
    assert _summary(capsys.readouterr().err) == (0, 0, 4)
    # The new question's head needs lines and labels only: every window is read, none extracted.
    assert cli_main([*argv, "--questions", str(second), "--out", str(tmp_path / "b"), "--no-base-model"]) == 0
    assert _summary(capsys.readouterr().err) == (4, 0, 0)
    card = json.loads((tmp_path / "b" / "card.json").read_text())
    assert card["tokens_extracted"] == 0 and set(card["questions"]) == {"trend", "sma", "ema"}
    assert card["questions"]["ema"]["base_model"] == {}
    # ...and only its head is fitted: the others' samples are the same, so are their fits
    assert {qid: q["fit_cached"] for qid, q in card["questions"].items()} == {"trend": True, "sma": True, "ema": False}
    a, b = ({h.question_id: h for h in load_adapter(tmp_path / d).heads} for d in "ab")
    for qid in ("trend", "sma"):  # the same states give the same heads, to the bit
        assert torch.equal(a[qid].proj, b[qid].proj) and torch.equal(a[qid].lags, b[qid].lags)
    # With the base model's figures, only the judged window (later; not train, not dev) branches the new question.
    assert cli_main([*argv, "--questions", str(second), "--out", str(tmp_path / "c")]) == 0
    assert _summary(capsys.readouterr().err) == (3, 1, 0)
    card = json.loads((tmp_path / "c" / "card.json").read_text())
    assert set(card["questions"]["ema"]["base_model"]) == {"later"} and "dev" in card["questions"]["ema"]["judged"]
    # The cached lines are those a run of its own extracts.
    assert cli_main([*argv, "--questions", str(second), "--out", str(tmp_path / "d"), "--no-cache"]) == 0
    own = sorted((tmp_path / "d" / "states").glob("*/window-*.safetensors"))
    assert len(own) == 4
    for path in own:
        cached = next((tmp_path / "cache").glob(f"*/{path.name}"))
        name = lines_name(LAYER, ())
        assert torch.equal(load_file(str(path))[name], load_file(str(cached))[name])


def test_window_labels_are_each_bars_expected_answer(spec, bars):
    """Labels come from one pass over the window (LabelSpec.truths), the same as bar by bar."""
    extra = [dataclasses.replace(spec.questions[1], id=f"x{i}", label=parse_label(text))
             for i, text in enumerate(("close > ema(close, 5)", "range > 2 * mean(range, 4)", "close[+3] > close"))]
    questions = [q for q in spec.questions if q.label is not None] + extra
    got = window_labels(questions, bars)
    for q in questions:
        want = [-1 if a is None else q.choices.index(a) for a in (q.expected_answer(bars[: i + 1])
                                                                 for i in range(len(bars)))]
        assert got[q.id] == want, q.label.text
    assert set(got["x2"]) == {-1}  # a forecast's truth is not in at its own bar
    assert {i for i in got["x0"] if i >= 0} == {0, 1}
