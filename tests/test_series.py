"""Series heads: per-line features tapped from the session's own ingest, and a readout over the last K lines.

References: transformers' hidden_states for the tapped rows, a one-shot computation for
the incremental line features, the extractor (what `tune` trains on) for the engine's
features, and the trainer's own forward for the saved head.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from feeds.sources import TableSource
from streamllm.cli.tune import main as cli_main
from streamllm.config import load_config
from streamllm.durability.snapshot import restore_session, save_session
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.engine.taps import LineTaps
from streamllm.model.adapter import AdapterError, SeriesHead, load_adapter, save_heads
from streamllm.model.llama import LlamaForward
from streamllm.model.lora import hf_model
from streamllm.model.seriesfit import _Model, feature_sets, fit_series, lag_basis, samples
from streamllm.tuning.extract import StateExtractor, render_window, session_ids
from tests.test_tune import CONFIG, LAYER, LINES, engine_with, random_series, write_bars


def test_tapped_rows_are_transformers_hidden_states(tiny_model):
    model = LlamaForward(tiny_model.config, tiny_model.state_dict)
    store = KVStore(BlockManager(16, 16), KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim))
    ids = tiny_model.tokenizer("10:00 100 +3 v1.0K\n10:01 102 +2 v1.1K\n")["input_ids"]
    reference = hf_model(tiny_model)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in range(model.num_layers):  # transformers' last hidden state is the normed one
        runner = Runner(model, store, tap_layer=layer)
        table = BlockTable()
        store.manager.append(table, len(ids))
        first, second = Work(table, ids[:7], 0, "none", want_tap=True), Work(table, ids[7:], 7, "last", want_tap=True)
        runner.execute([first])
        runner.execute([second])  # a second chunk reads the first's cells
        store.manager.free(table)
        torch.testing.assert_close(torch.cat([first.tap, second.tap]), reference[layer][0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no tap_layer"):
        Runner(model, store).execute([Work(BlockTable(), ids[:1], 0, want_tap=True)])


def test_a_forward_stopped_at_the_tap_gives_the_full_forwards_tap_and_leaves_the_layers_above_alone(tiny_model):
    model = LlamaForward(tiny_model.config, tiny_model.state_dict)
    ids = tiny_model.tokenizer("10:00 100 +3 v1.0K\n10:01 102 +2 v1.1K\n")["input_ids"]
    layer = 1
    taps, pools = [], []
    for tap_only in (False, True):
        store = KVStore(BlockManager(16, 16), KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim))
        store.pool.k.zero_()  # the pool's cells start as torch.empty
        store.pool.v.zero_()
        runner = Runner(model, store, tap_layer=layer)
        table = BlockTable()
        store.manager.append(table, len(ids))
        first, second = Work(table, ids[:7], 0, "none", want_tap=True), Work(table, ids[7:], 7, "none", want_tap=True)
        assert runner.execute([first], tap_only=tap_only) == [None]
        runner.execute([second], tap_only=tap_only)  # the second chunk reads the first's cells below the tap
        taps.append(torch.cat([first.tap, second.tap]))
        pools.append(store.pool)
    assert torch.equal(taps[0], taps[1])  # exactly: the same ops on the same rows
    full, stopped = pools
    assert torch.equal(full.k[:layer], stopped.k[:layer]) and torch.equal(full.v[:layer], stopped.v[:layer])
    assert not stopped.k[layer:].any() and not stopped.v[layer:].any()  # never written above the tap
    store = KVStore(BlockManager(16, 16), KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim))
    with pytest.raises(ValueError, match="tap alone"):
        Runner(model, store, tap_layer=layer).execute([Work(BlockTable(), ids[:1], 0, "last", want_tap=True)],
                                                      tap_only=True)


# Token ids of a toy session: 9 starts a word (like "Ġ4"), 7 too (like "Ġv"), 6 too but spells nothing
# (like a bare "Ġ"), 8 is the newline (also whitespace); 5 prefix tokens.
TOY_IDS = [1, 1, 1, 1, 1,  2, 3, 9, 8,  2, 9, 8,  2, 2, 9, 3, 7, 3, 3, 8,  8,  2, 9, 6, 4, 7, 3, 9, 3, 8]
TOY_ENDS, TOY_PREFIX = [9, 12, 20, 21, 30], 5
TOY_STARTS = frozenset({6, 7, 8, 9})
TOY_TEXTS = ("", "x", "1", "2", "v", "", "", "v", "", "4")  # each id's text without its whitespace mark


def toy_words(b: int, e: int) -> list[tuple[str, int]]:
    """(text, last token) of each word of the line [b, e): a word starts at the line's first token or a word start."""
    starts = [b] + [t for t in range(b + 1, e) if TOY_IDS[t] in TOY_STARTS]
    return [("".join(TOY_TEXTS[TOY_IDS[t]] for t in range(s, n)), n - 1) for s, n in zip(starts, starts[1:], strict=False)]


def toy_expected(rows: torch.Tensor, words: tuple[int | str, ...]) -> torch.Tensor:
    """[mean, last, then each word's last token: by index, or the first word whose text starts with the prefix]."""
    out = []
    for b, e in zip([TOY_PREFIX, *TOY_ENDS[:-1]], TOY_ENDS, strict=True):
        found = toy_words(b, e)
        marks = []
        for w in words:
            if isinstance(w, int):
                last = found[w][1] if w < len(found) else None
            else:
                last = next((n for text, n in found if text.startswith(w)), None)
            marks.append(rows[last] if last is not None else torch.zeros(rows.shape[1]))
        out.append(torch.cat([rows[b:e].mean(0), rows[e - 1], *marks]))
    return torch.stack(out)


def test_toy_lines_spell_what_the_prefix_cases_need():
    assert [t for t, _ in toy_words(12, 20)] == ["11", "42", "v22"]  # v after other words
    assert [t for t, _ in toy_words(21, 30)] == ["1", "4", "v", "v2", "42"]  # "v" spelled over 2 tokens; twice


@pytest.mark.parametrize("words", [(), (0, 2), (1, 3), ("v",), (2, "v", "42", "v2")])
def test_line_features_in_any_chunking_equal_one_shot(words):
    torch.manual_seed(0)
    prefix, ends = TOY_PREFIX, TOY_ENDS
    rows = torch.randn(30, 4)

    def taps_of(keep):
        return LineTaps(keep, words, TOY_STARTS, TOY_TEXTS)

    one = taps_of(10)
    one.add(rows, 0, TOY_IDS, ends, 0, prefix)
    expected = toy_expected(rows, words)
    assert expected.shape == (5, (2 + len(words)) * 4)
    torch.testing.assert_close(one.window(5, 5), expected)
    for cuts in ([3, 10, 11, 25], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 29], [20]):
        taps = taps_of(10)
        for a, b in zip([0, *cuts], [*cuts, 30], strict=True):
            taps.add(rows[a:b], a, TOY_IDS[a:b], ends, 0, prefix)
        torch.testing.assert_close(taps.window(5, 5), expected)
    assert one.window(3, 2) is not None and one.window(3, 4) is None  # only lines 1, 2 before line 3; not 4
    # Met mid-line (a restored session): that line has no features, so a window across it is None.
    restored = taps_of(10)
    restored.add(rows[15:], 15, TOY_IDS[15:], ends, 0, prefix)
    assert restored.num_lines == 5 and restored.window(5, 2) is not None and restored.window(5, 3) is None
    for taps_, upto, count in ((one, 3, 2), (one, 3, 4), (restored, 5, 2), (restored, 5, 3), (restored, 9, 0)):
        assert taps_.holds(upto, count) == (taps_.window(upto, count) is not None)  # the check head-only entries use
    # After a compaction the line numbers go on: line_ends shifted, lines_before counts the cut ones.
    taps = taps_of(3)
    taps.add(rows[:12], 0, TOY_IDS[:12], ends, 0, prefix)
    taps.add(rows[12:20], 5, TOY_IDS[12:20], [13, 14, 23], 2, prefix)  # cut at token 12: 7 tokens and 2 lines gone
    assert [i for i, _ in taps.lines] == [0, 1, 2] and taps.window(3, 3) is not None
    torch.testing.assert_close(taps.window(3, 3), expected[:3])


def test_word_starts_come_from_the_tokenizer(tiny_model):
    from streamllm.engine.prompt import PromptLayout
    from streamllm.engine.taps import word_tables

    starts, _ = word_tables(tiny_model.tokenizer, (1,))
    ids = PromptLayout(tiny_model.tokenizer).lines_ids(["23:02 46411 +34 h+5"])[0]
    pieces, word = [], []  # split the line's tokens where a word starts: the words come back whole
    for i, t in enumerate(ids):
        if i and t in starts:
            pieces.append(word)
            word = []
        word.append(t)
    pieces.append(word)
    texts = [tiny_model.tokenizer.decode(p).strip() for p in pieces]
    assert texts[:4] == ["23:02", "46411", "+34", "h+5"]
    with pytest.raises(ValueError, match="word-start"):
        LineTaps(4, (2,))
    with pytest.raises(ValueError, match="token texts"):
        LineTaps(4, ("v",), starts)
    for bad in ((-1,), (2, 2), ("",), ("v 1",), (True,), (1.5,)):
        with pytest.raises(ValueError, match="word"):
            LineTaps(4, bad, starts, ())


def test_prefix_words_find_a_bars_volume_wherever_it_stands(tiny_model):
    """`v` is the volume word in every bar line, whichever optional fields come before it."""
    from streamllm.engine.taps import word_tables

    tok = tiny_model.tokenizer
    starts, texts = word_tables(tok, ("v",))
    lines = ["23:02 46411 +34 v1.83M\n", "23:03 46420 +9 o-2 h+5 l-12 v980K n210 b58\n",
             "2024-08-09T00:00 61837.63 +0.12 v12.3 n5 b40\n", "23:04 46420 no trades\n"]
    ids = [tok(line, add_special_tokens=False)["input_ids"] for line in lines]
    flat = [t for line in ids for t in line]
    ends = list(itertools.accumulate(len(line) for line in ids))
    rows = torch.arange(len(flat), dtype=torch.float32)[:, None]  # each row says which token it is
    taps = LineTaps(8, ("v",), starts, texts)
    taps.add(rows, 0, flat, ends, 0, 0)
    got = [int(f[2]) for _, f in taps.lines]
    for line, line_ids, last, start in zip(lines, ids, got[:3], [0, *ends], strict=False):
        word = next(w for w in line.split() if w.startswith("v"))
        assert tok.decode(line_ids[: last - start + 1]).split()[-1] == word  # the token ending the v word
    assert got[3] == 0  # no volume word: zeros


@pytest.mark.parametrize("words", [(), (1, 2), (2, "v")])
def test_the_engine_reads_the_lines_tune_trains_on(tiny_model, spec, bars, tmp_path, words):
    """Same features in serving as in training, and the gate answers with the series head."""
    labelled = [q for q in spec.questions if q.label is not None]
    heads = random_series(spec, tiny_model.config.hidden_size, words=words)
    heads[1].threshold = math.inf
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    adapter = load_adapter(tmp_path / "ad")
    assert [h.kind for h in adapter.heads] == ["series", "series"] and adapter.tap_words == words
    states = StateExtractor(tiny_model, spec, labelled, tap_layer=LAYER, words=words).extract(bars[:20], stride=5)
    assert states.lines.shape[1] == (2 + len(words)) * tiny_model.config.hidden_size
    engine = engine_with(tiny_model, tmp_path / "ad")
    try:
        engine.open_session("test", system=spec.system_prompt)
        for q in spec.questions:
            engine.register("test", q)
        lines = render_window(bars[:20])
        for upto, batch in ((9, lines[:10]), (16, lines[10:17])):  # two pushes: batching changes nothing
            engine.push("test", batch)
            engine.wait_idle()
            trend = engine.prepos.find("test", "trend")
            torch.testing.assert_close(trend.ready_hidden, states.lines[upto + 1 - LINES: upto + 1], atol=1e-5, rtol=1e-5)
        scores = heads[0].logits(trend.ready_hidden)
        answer = engine.ask("test", "trend")
        assert answer.path == "fast" and answer.text == ("up", "down")[int(scores.argmax())]
        assert answer.confidence == pytest.approx(float(scores.max() - scores.min()), abs=1e-4)
        sma = engine.prepos.find("test", "sma")
        answer = engine.ask("test", "sma")  # never confident: the entry answers, still with the head's choice
        assert answer.path == "entry" and answer.text == ("yes", "no")[int(heads[1].logits(sma.ready_hidden).argmax())]
        assert engine.prepos.find("test", "free").gate.head is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("head_entries", [False, True])
def test_a_sessions_first_lines_are_read_as_tune_trained_them(tiny_model, spec, bars, tmp_path, head_entries):
    """Heads trained on window starts (min_lines) answer a new session from its min_lines-th line, over
    all its lines (the newest lags); before that the LM's choice scores answer, as for older heads."""
    labelled = [q for q in spec.questions if q.label is not None]
    heads = random_series(spec, tiny_model.config.hidden_size, words=(2, "v"))
    for h in heads:
        h.min_lines = 3
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    assert [h.min_lines for h in load_adapter(tmp_path / "ad").heads] == [3, 3]
    states = StateExtractor(tiny_model, spec, labelled, tap_layer=LAYER, words=(2, "v")).extract(bars[:8], stride=5)
    engine = engine_with(tiny_model, tmp_path / "ad", head_entries=head_entries)
    try:
        engine.open_session("test", system=spec.system_prompt)
        engine.register("test", spec.questions[0])
        for n, line in enumerate(render_window(bars[:8]), 1):
            engine.push("test", [line])
            assert engine.wait_idle()
            trend = engine.prepos.find("test", "trend")
            answer = engine.ask("test", "trend")
            if n < 3:
                assert trend.ready_hidden is None
                continue
            held = states.lines[max(0, n - LINES): n]
            torch.testing.assert_close(trend.ready_hidden, held, atol=1e-5, rtol=1e-5)
            scores = heads[0].logits(held)
            assert answer.text == ("up", "down")[int(scores.argmax())]
            assert answer.confidence == pytest.approx(float(scores.max() - scores.min()), abs=1e-4)
        assert engine.stats()["head_only_entries"] == (6 if head_entries else 0)  # lines 3..8
    finally:
        engine.shutdown()


def test_head_only_entries_answer_as_prefilled_ones_without_their_forward_pass(tiny_model, spec, bars, tmp_path):
    """A choice question a series head decides needs the session's lines, not the question's prefill:
    the same standing answers at every version, and no entry tokens once the head's lines are held."""
    heads = random_series(spec, tiny_model.config.hidden_size, words=(2, "v"))
    heads[1].threshold = math.inf  # one never fires: the entry path's answers are compared too
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    lines = render_window(bars[:20])
    seen, stats = {}, {}
    for head_entries in (False, True):
        engine = engine_with(tiny_model, tmp_path / "ad", head_entries=head_entries)
        try:
            engine.open_session("test", system=spec.system_prompt)
            for q in spec.questions:
                engine.register("test", q)
            seen[head_entries] = []
            for i in range(0, 20, 2):
                engine.push("test", lines[i: i + 2])
                assert engine.wait_idle()
                for q in ("trend", "sma"):
                    a = engine.ask("test", q)
                    seen[head_entries].append((q, a.data_version, a.text, a.path, round(a.confidence, 4),
                                               {k: round(v, 4) for k, v in a.choices.items()}))
            stats[head_entries] = engine.stats()
        finally:
            engine.shutdown()
    assert seen[True] == seen[False]
    assert {p for *_, p, _, _ in seen[True]} == {"fast", "entry"}
    # Versions 1-2 hold fewer than LINES lines: both engines prefill those entries (the LM decides).
    assert stats[False]["head_only_entries"] == 0
    assert stats[True]["head_only_entries"] == 2 * 8  # trend and sma at versions 3..10
    free = stats[False]["entry_tokens"] - stats[True]["entry_tokens"]  # the head-only entries' prefill
    assert free > 0 and stats[True]["entries_computed"] == stats[False]["entries_computed"]


def test_head_only_entries_answer_as_prefilled_ones_across_compactions(tiny_model, spec, bars, tmp_path):
    """Compactions cut lines and rebase entries: the answers stay those of prefilled entries."""
    save_heads(tmp_path / "ad", random_series(spec, tiny_model.config.hidden_size, words=(2, "v")),
               model=tiny_model.name)
    lines = render_window(bars)
    seen, compactions = {}, {}
    for head_entries in (False, True):
        # compact_early=0: both runs cut at the same token counts, however fast this machine steps
        engine = engine_with(tiny_model, tmp_path / "ad", max_context=512, head_entries=head_entries,
                             compact_early=0)
        try:
            engine.open_session("test", system=spec.system_prompt)
            engine.register("test", spec.questions[0])
            seen[head_entries] = []
            for i in range(0, 40, 2):
                engine.push("test", lines[i: i + 2])
                assert engine.wait_idle()
                a = engine.ask("test", "trend")
                seen[head_entries].append((a.data_version, a.text, a.path, round(a.confidence, 4)))
            stats = engine.stats()
            compactions[head_entries] = (stats["compactions"], stats["head_only_entries"])
        finally:
            engine.shutdown()
    assert compactions[False][0] == compactions[True][0] >= 1
    assert compactions[False][1] == 0 and compactions[True][1] >= 10
    assert seen[True] == seen[False]


def test_line_numbers_survive_compaction(tiny_model, spec, bars, tmp_path):
    save_heads(tmp_path / "ad", random_series(spec, tiny_model.config.hidden_size), model=tiny_model.name)
    engine = engine_with(tiny_model, tmp_path / "ad", max_context=512)
    try:
        engine.open_session("test", system=spec.system_prompt)
        engine.register("test", spec.questions[0])
        lines = render_window(bars)
        for i in range(0, 40, 2):  # pushes well under the budget: every line is computed before a cut
            engine.push("test", lines[i: i + 2])
            engine.wait_idle()
        st = engine.prepos.find("test", "trend")
        s = st.session
        assert s.compactions >= 1
        assert s.lines_upto(s.num_tokens) == 40 and s.taps.num_lines == 40
        assert st.ready_hidden is not None and st.ready_hidden.shape == (LINES, 2 * tiny_model.config.hidden_size)
    finally:
        engine.shutdown()


def rule_window(g: torch.Generator, n: int, width: int, column: int = 0,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """n lines of `width` random features; a line's label: is the sum of `column` over it and the 3
    lines before it positive (choice 0) or not (choice 1)."""
    feats = torch.randn(n, width, generator=g) * scale
    sums = torch.stack([feats[max(0, i - 3): i + 1, column].sum() for i in range(n)])
    return feats, (sums <= 0).long()


def test_fit_series_learns_a_rule_across_lines_and_the_saved_head_is_the_trained_one():
    g = torch.Generator().manual_seed(0)

    def window(n):  # label: the sum of feature 0 over the last 4 lines is positive
        feats = torch.randn(n, 10, generator=g) * torch.tensor([1.0] + [3.0] * 9) + 5.0
        sums = torch.stack([feats[max(0, i - 3): i + 1, 0].sum() - 5.0 * 4 for i in range(n)])
        return feats, (sums <= 0).long()

    # A window's first bars (4 or 5 of the 6 lines: the rule's whole history) are samples too.
    train, dev = samples([window(60) for _ in range(20)], 6, 4), samples([window(60) for _ in range(40)], 6, 4)
    assert sorted(dev.reads.unique().tolist()) == [4, 5, 6] and len(dev) == 40 * 57
    fit = fit_series(train, dev, 2, k=6, rank=2, steps=300)
    head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, (), 4)
    for n in (4, 5, 6):
        sub = dev.subset(dev.reads == n)
        assert (sub.logits(head).argmax(1) == sub.labels).float().mean() > 0.9
    model = _Model(10, 2, 6, 2)  # the trainer's forward on raw features, with the folded weights
    model.load_state_dict({"proj.weight": fit.proj, "proj.bias": fit.proj_bias, "lags": fit.lags, "bias": fit.bias})
    with torch.no_grad():  # the trainer's masked lines are the served head's newest lags
        torch.testing.assert_close(model(dev.lines, dev.index, dev.mask), dev.logits(head), atol=1e-4, rtol=1e-4)
    assert [head.reads(n) for n in (3, 4, 5, 6, 9)] == [6, 4, 5, 6, 6]  # below min_lines: whole windows only
    with pytest.raises(ValueError, match="of 6 lines read 7"):
        head.logits(torch.zeros(7, 10))


def test_a_lag_basis_learns_a_long_average_from_few_samples_and_serves_what_it_trained():
    """A label that weighs 40 lines smoothly (an exponential average's side) from 400 samples: with every lag
    its own weight the head overfits; fitted as a few shapes (lag_basis) it generalizes. The folded [C, K, 2R]
    lags served are exactly the trained ones (the trainer's forward on them gives the served logits)."""
    g = torch.Generator().manual_seed(3)
    k, decay = 40, torch.exp(-torch.arange(39, -1, -1) / 15.0)

    def window(n):
        feats = torch.randn(n, 3, generator=g)
        score = torch.stack([(feats[i - k + 1: i + 1, 0] * decay).sum() for i in range(k - 1, n)])
        labels = torch.full((n,), -1)
        labels[k - 1:] = (score <= 0).long()
        return feats, labels

    train, dev, test = (samples([window(n) for _ in range(w)], k) for n, w in ((240, 2), (140, 1), (540, 2)))
    accuracy = {}
    for name, basis in (("free", None), ("basis", lag_basis(k, 4))):
        fit = fit_series(train, dev, 2, k=k, rank=2, grid=(1e-2,), steps=400, lag_basis=basis)
        head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, ())
        accuracy[name] = float((test.logits(head).argmax(1) == test.labels).float().mean())
        model = _Model(3, 2, k, 2)
        model.load_state_dict({"proj.weight": fit.proj, "proj.bias": fit.proj_bias, "lags": fit.lags, "bias": fit.bias})
        with torch.no_grad():
            torch.testing.assert_close(model(test.lines, test.index, test.mask), test.logits(head), atol=1e-4, rtol=1e-4)
    assert accuracy["basis"] > 0.85 and accuracy["basis"] > accuracy["free"] + 0.05, accuracy
    basis = lag_basis(k, 4)
    torch.testing.assert_close(basis.norm(dim=0), torch.ones(basis.shape[1]))
    assert torch.equal(basis[:, :4] > 0, torch.eye(k)[:, k - 4:] > 0)  # the newest 4 lags: one column each
    with pytest.raises(ValueError, match="free lags"):
        lag_basis(4, 5)
    with pytest.raises(ValueError, match="lag basis of 40 rows for a head of 6"):
        fit_series(train, dev, 2, k=6, lag_basis=basis)


def test_a_feature_constant_in_training_gets_no_weight():
    """A number slot no training line writes (zero throughout) taught the head nothing: a value first seen
    when serving leaves its logits as they were (its weight was its initial value over the clamped spread)."""
    g = torch.Generator().manual_seed(1)

    def window(n):
        feats = torch.randn(n, 4, generator=g)
        feats[:, 3] = 0.0  # never written while training
        return feats, (feats[:, 0] > 0).long()

    train, dev = samples([window(40) for _ in range(10)], 2), samples([window(40) for _ in range(4)], 2)
    fit = fit_series(train, dev, 2, k=2, rank=2, steps=60)
    assert torch.all(fit.proj[:, 3] == 0) and torch.all(fit.proj[:, :3].abs().sum(0) > 0)
    head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, (), 1)
    lines = torch.randn(2, 4, generator=g)
    lines[:, 3] = 0.0
    seen = lines.clone()
    seen[:, 3] = 250.0
    torch.testing.assert_close(head.logits(seen), head.logits(lines))


def test_fit_series_reads_the_words_alone_when_they_hold_the_rule():
    """Lines [mean, last, word] 4 wide each; the label sums the word's first number: the fit picks the words
    alone (the development loss prefers fewer noisy weights) and the unread columns get zero weights."""
    g = torch.Generator().manual_seed(1)
    train = samples([rule_window(g, 40, 12, column=8, scale=3.0) for _ in range(6)], 6)
    dev = samples([rule_window(g, 40, 12, column=8, scale=3.0) for _ in range(4)], 6)
    fit = fit_series(train, dev, 2, k=6, rank=2, steps=300, sets=feature_sets(4, 1))
    assert fit.features == "words" and fit.proj[:, :8].abs().max() == 0 and fit.proj[:, 8:].abs().max() > 0
    head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, (2,))
    assert (dev.logits(head).argmax(1) == dev.labels).float().mean() > 0.9


def test_tune_series_writes_an_adapter_the_engine_serves(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr("streamllm.model.loader.load_model", lambda *a, **k: tiny_model)
    config, data = tmp_path / "q.toml", write_bars(tmp_path / "bars.csv", 600)
    config.write_text(CONFIG)
    out = tmp_path / "out"
    argv = ["--questions", str(config), "--data", str(data), "--out", str(out), "--model", "tiny",
            "--method", "series", "--tap-layer", "1", "--lines", "10", "--window", "40", "--stride", "8",
            "--train-windows", "6", "--dev-windows", "2", "--later-windows", "2", "--synthetic-bars", "0",
            "--no-progress", "--fit-orders", "2", "--target-precision", "0.8"]  # 2 orders: the mean still served
    assert cli_main(argv) == 0
    adapter = load_adapter(out)
    assert {h.kind for h in adapter.heads} == {"series"} and adapter.tap_layer == 1 and adapter.tap_lines == 10
    assert adapter.tap_words == (2, "v")  # the default: a bar line's change and volume
    card = (out / "card.md").read_text()
    assert "Series heads" in card and "| trend | later |" in card and "word 2's last token, the v... word's last token" in card
    # Trained on window starts from each label's first known bar: the engine reads a session's first lines.
    assert {h.question_id: h.min_lines for h in adapter.heads} == {"trend": 5, "sma": 8}
    assert "A session's first lines (fewer than 10 held)" in card and "min lines: trend 5, sma 8" in card
    judged = json.loads((out / "card.json").read_text())["questions"]["trend"]["judged"]["later"]
    assert "| ECE |" in card and 0 <= judged["ece"] <= 1 and judged["log_loss"] > 0
    # How sure: block-bootstrap intervals, blocks of the label's 5 bars inside each of the 2 later windows.
    lo, hi = judged["accuracy_interval"]
    assert lo <= judged["accuracy"] <= hi
    lo, hi = judged["coverage_at_target_interval"]
    assert 0 <= lo <= hi <= 1
    assert f"| {judged['accuracy']:.2f} ({judged['accuracy_interval'][0]:.2f}-" in card
    assert "block-bootstrap resamples" in card
    engine = engine_with(tiny_model, out)
    try:
        spec = load_config(config).sessions[0]
        engine.open_session("test", system=spec.system_prompt)
        engine.register("test", spec.questions[0])
        engine.push("test", render_window(TableSource(data, "bar", instrument="TEST").events()[:12]))
        engine.wait_idle()
        assert engine.ask("test", "trend").text in ("up", "down")
    finally:
        engine.shutdown()
    with pytest.raises(SystemExit):
        cli_main([*argv[:-2], "--tap-layer", "x"])
    assert cli_main([*argv, "--lines", "4"]) == 2  # shorter than the labels' history
    with pytest.raises(SystemExit):
        cli_main([*argv, "--words", "2,2"])
    with pytest.raises(SystemExit):
        cli_main([*argv, "--words", "-1"])


def test_series_files_are_checked(tiny_model, spec, tmp_path):
    heads = random_series(spec, tiny_model.config.hidden_size)
    heads[1].layer = 2
    with pytest.raises(AdapterError, match="one layer"):
        save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    heads[1].layer = 7
    heads[0].layer = 7
    save_heads(tmp_path / "ad", heads, model=tiny_model.name)
    with pytest.raises(AdapterError, match="layer 7"):
        engine_with(tiny_model, tmp_path / "ad")
    ids, ends = session_ids(StateExtractor(tiny_model, spec, []).layout, [1, 2], ["a", "b"])
    assert ends[-1] == len(ids)
    heads = random_series(spec, tiny_model.config.hidden_size, words=(2,))
    heads[1] = random_series(spec, tiny_model.config.hidden_size)[1]
    with pytest.raises(AdapterError, match="one layer and words"):
        save_heads(tmp_path / "ad2", heads, model=tiny_model.name)
    with pytest.raises(AdapterError, match="bad words"):
        save_heads(tmp_path / "ad3", random_series(spec, tiny_model.config.hidden_size, words=("v 1",)),
                   model=tiny_model.name)
    # A file whose words are not a list (a hand-edited "v") is refused, not read as ["v"].
    from safetensors.torch import load_file, safe_open, save_file

    path = save_heads(tmp_path / "ad4", random_series(spec, tiny_model.config.hidden_size, words=("v",)),
                      model=tiny_model.name)
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["streamllm"])
    for q in meta["questions"]:
        q["words"] = "v"
    save_file(load_file(str(path)), str(path), metadata={"streamllm": json.dumps(meta)})
    with pytest.raises(AdapterError, match="bad words"):
        load_adapter(tmp_path / "ad4")


@pytest.mark.parametrize("words", [(), (2,), (2, "v")])
def test_a_restored_session_keeps_its_line_features(tiny_model, spec, bars, tmp_path, words):
    """Snapshots carry the lines, so series heads answer right after a restore, as before it."""
    save_heads(tmp_path / "ad", random_series(spec, tiny_model.config.hidden_size, words=words), model=tiny_model.name)
    engine = engine_with(tiny_model, tmp_path / "ad")
    try:
        engine.open_session("test", system=spec.system_prompt)
        engine.register("test", spec.questions[0])
        lines = render_window(bars[:20])
        engine.push("test", lines[:12])
        engine.wait_idle()
        before = engine.prepos.find("test", "trend").ready_hidden.clone()
        save_session(engine, "test", tmp_path / "s.safetensors")
        restore_session(engine, tmp_path / "s.safetensors", "copy")
        engine.wait_idle()
        restored = engine.prepos.find("copy", "trend")
        torch.testing.assert_close(restored.ready_hidden, before)
        engine.push("copy", lines[12:14])  # and it goes on from there, line numbers and all
        engine.push("test", lines[12:14])
        engine.wait_idle()
        torch.testing.assert_close(engine.prepos.find("copy", "trend").ready_hidden,
                                   engine.prepos.find("test", "trend").ready_hidden, atol=1e-5, rtol=1e-5)
    finally:
        engine.shutdown()


def test_fits_over_several_orders_serve_their_mean_in_the_heads_own_format():
    """orders=3: three fits of the chosen candidate, each its own minibatch order; the served head (rank 3R,
    one SeriesHead) gives the mean of the three fits' logits, and the dev loss reported is its own."""
    from streamllm.model.seriesfit import _stack

    g = torch.Generator().manual_seed(2)
    train = samples([rule_window(g, 40, 10) for _ in range(8)], 6)
    dev = samples([rule_window(g, 40, 10) for _ in range(4)], 6)
    states = []
    for order in range(3):  # three fits of one candidate, as fit_series draws them
        torch.manual_seed(order)
        model = _Model(10, 2, 6, 2)
        torch.nn.init.normal_(model.lags)
        states.append({n: p.detach().clone() for n, p in model.state_dict().items()})
    mean = torch.stack([_fitted_logits(s, dev) for s in states]).mean(0)
    stacked = _stack(states, 2)
    assert stacked["proj.weight"].shape == (6, 10) and stacked["lags"].shape == (2, 6, 12)
    torch.testing.assert_close(_fitted_logits(stacked, dev), mean, atol=1e-5, rtol=1e-5)

    fit = fit_series(train, dev, 2, k=6, rank=2, steps=200, orders=3, grid=(1e-2,))
    assert fit.proj.shape == (6, 10) and fit.lags.shape == (2, 6, 12)
    head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, ())
    served = float(torch.nn.functional.cross_entropy(dev.logits(head), dev.labels))
    assert abs(served - fit.dev_loss) < 1e-4
    assert (dev.logits(head).argmax(1) == dev.labels).float().mean() > 0.85
    once = fit_series(train, dev, 2, k=6, rank=2, steps=200, orders=1, grid=(1e-2,))
    assert once.proj.shape == (2, 10)
    with pytest.raises(ValueError, match="orders"):
        fit_series(train, dev, 2, k=6, rank=2, orders=0)


def _fitted_logits(state, s):
    model = _Model(state["proj.weight"].shape[1], 2, 6, state["proj.weight"].shape[0])
    model.load_state_dict(state)
    with torch.no_grad():
        return model(s.lines, s.index, s.mask)


def test_the_simplest_candidate_within_one_standard_error_is_served():
    """choose="simplest" (the one-standard-error rule): a candidate reading fewer columns, then one with
    more weight decay, wins whenever its mean development loss is within the best's standard error."""
    from streamllm.model.seriesfit import choose_candidate

    widths = {"all": 4, "words": 2}
    spread = {("all", 1e-3): (0.300, 0.010), ("all", 1e-1): (0.305, 0.004),
              ("words", 1e-3): (0.309, 0.002), ("words", 1e-1): (0.3095, 0.001), ("words", 1e-2): (0.32, 0.0)}
    assert choose_candidate(spread, widths, "best") == ("all", 1e-3)
    assert choose_candidate(spread, widths, "simplest") == ("words", 1e-1)  # within 0.300 + 0.010
    spread[("all", 1e-3)] = (0.300, 0.005)  # the words alone now worse by more than the fits' spread
    assert choose_candidate(spread, widths, "simplest") == ("all", 1e-1)
    spread = {c: (m, 0.0) for c, (m, _) in spread.items()}  # one order: no spread, the best is served
    assert choose_candidate(spread, widths, "simplest") == ("all", 1e-3)


def test_fit_series_reports_every_candidate_and_serves_the_rules_choice():
    from streamllm.model.seriesfit import choose_candidate

    g = torch.Generator().manual_seed(1)  # the label sums the word's first number; [mean, last] are noise
    train = samples([rule_window(g, 40, 12, column=8, scale=3.0) for _ in range(6)], 6)
    dev = samples([rule_window(g, 40, 12, column=8, scale=3.0) for _ in range(4)], 6)
    fit = fit_series(train, dev, 2, k=6, rank=2, steps=100, sets=feature_sets(4, 1), orders=2, choose="simplest")
    assert set(fit.candidates) == {(n, w) for n in ("all", "words") for w in (1e-3, 1e-2, 1e-1)}
    assert all(se >= 0 for _, se in fit.candidates.values())
    assert (fit.features, fit.weight_decay) == choose_candidate(fit.candidates, {"all": 12, "words": 4}, "simplest")
    with pytest.raises(ValueError, match="choose must be best or simplest"):
        fit_series(train, dev, 2, k=6, rank=2, choose="lowest")


def test_a_reduced_fit_reads_principal_components_and_serves_them_folded_onto_the_raw_features():
    """reduce=6 on 40 columns that mix 4 latent numbers: the fit reads the lines' 6 leading components, and
    the [R, 40] projection served gives the trained model's own development loss (the components and the
    standardization folded in), learns the rule, and is the same head from the same samples."""
    g = torch.Generator().manual_seed(3)
    mixing = torch.randn(4, 40, generator=g) * torch.linspace(0.5, 3.0, 40)

    def window(n):  # label: the first latent number summed over the last 4 lines is positive
        latent = torch.randn(n, 4, generator=g)
        sums = torch.stack([latent[max(0, i - 3): i + 1, 0].sum() for i in range(n)])
        return latent @ mixing + 0.05 * torch.randn(n, 40, generator=g) + 2.0, (sums <= 0).long()

    train, dev = samples([window(60) for _ in range(12)], 6), samples([window(60) for _ in range(6)], 6)
    fit = fit_series(train, dev, 2, k=6, rank=2, steps=200, grid=(1e-2,), reduce=6)
    assert fit.proj.shape == (2, 40)
    head = SeriesHead("q", "q?", ("yes", "no"), 0, fit.proj, fit.proj_bias, fit.lags, fit.bias, 0.0, ())
    served = float(torch.nn.functional.cross_entropy(dev.logits(head), dev.labels))
    trained, _ = fit.candidates[("all", 1e-2)]  # the best step's loss, measured on the components
    assert abs(served - trained) < 1e-4 and abs(served - fit.dev_loss) < 1e-4
    assert (dev.logits(head).argmax(1) == dev.labels).float().mean() > 0.9
    again = fit_series(train, dev, 2, k=6, rank=2, steps=200, grid=(1e-2,), reduce=6)
    assert torch.equal(again.proj, fit.proj) and torch.equal(again.lags, fit.lags)


def test_a_fit_is_the_same_in_every_process():
    """Two processes fitting the same samples on two threads serve the same head to the bit. Without
    deterministic kernels the gather's backward summed in thread order and every run differed."""
    import subprocess
    import sys

    script = """
import hashlib, torch
torch.set_num_threads(2)
from streamllm.model.seriesfit import fit_series, samples
from tests.test_series import rule_window
g = torch.Generator().manual_seed(0)
train = samples([rule_window(g, 250, 64) for _ in range(40)], 24)
dev = samples([rule_window(g, 250, 64) for _ in range(4)], 24)
fit = fit_series(train, dev, 2, k=24, rank=8, steps=60, grid=(0.1,))
print(hashlib.sha256(fit.proj.numpy().tobytes() + fit.lags.numpy().tobytes()).hexdigest())
assert not torch.are_deterministic_algorithms_enabled()  # the process's own setting, restored
"""
    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           cwd=root).stdout for _ in range(3)]
    assert runs[0] and runs.count(runs[0]) == 3
