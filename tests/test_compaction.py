"""Context budget: a session at its max_context is compacted in the background, never stopped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from streamllm.config import QuestionSpec
from streamllm.engine import CompactionPolicy, Engine, EngineConfig, SchedulerConfig

LINES = [f"12:{i // 60:02d}:{i % 60:02d} BTCUSDT C 640{i % 97:02d}.5 v{i % 13}.5 n{i % 7}" for i in range(400)]


@pytest.fixture()
def engine(tiny_model):
    eng = Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=640, scheduler=SchedulerConfig(chunk_tokens=32, step_tokens=64), compaction=CompactionPolicy(compact_at=0.75, retain=0.5, method="recompute")))
    yield eng
    eng.shutdown()


def retained_lines(engine, name, pushed):
    """The suffix of `pushed` whose tokens the (compacted) session holds after its prefix."""
    s = engine.sessions[name]
    data = s.token_ids[s.prefix_len :]
    for k in range(1, len(pushed) + 1):
        ids = [t for line in engine.layout.lines_ids(pushed[-k:]) for t in line]
        if ids == data:
            return pushed[-k:]
    raise AssertionError("the session's data is not a suffix of what was pushed")


def test_a_long_stream_is_compacted_and_answers_match_a_fresh_session(engine):
    engine.open_session("s")
    engine.register("s", QuestionSpec("q", "Next?", threshold=0.0, max_tokens=1))
    pushed = []
    for i in range(0, 120, 3):
        batch = LINES[i : i + 3]
        engine.push("s", batch)  # never refused: compaction keeps room
        pushed += batch
        engine.wait_idle()
    s = engine.sessions["s"]
    assert s.compactions >= 1 and s.num_tokens <= s.max_context
    assert engine.session_info("s").data_version == 40  # versions keep counting across swaps
    kept = retained_lines(engine, "s", pushed)
    assert 0 < len(kept) < len(pushed)
    engine.open_session("fresh")
    engine.push("fresh", kept)
    engine.wait_idle()
    assert engine.sessions["fresh"].token_ids == s.token_ids
    compacted = engine.ask("s", "Trend?", max_tokens=3, return_logits=True)
    fresh = engine.ask("fresh", "Trend?", max_tokens=3, return_logits=True)
    assert compacted.tokens == fresh.tokens
    assert (compacted.logits - fresh.logits).abs().max().item() <= 1e-4
    assert engine.ask("s", "q").data_version == 40  # standing questions re-positioned on the new blocks
    engine.check_integrity()


SHIFTING = EngineConfig(max_cells=16384, block_size=8, max_context=640,
                        scheduler=SchedulerConfig(chunk_tokens=32, step_tokens=64),
                        compaction=CompactionPolicy(compact_at=0.75, retain=0.5, method="shift"))


def shifted_reference(loaded, before: list[int], prefix: int, shift: int, rest: list[int]) -> torch.Tensor:
    """transformers' logits after `rest`, on its own cache of `before` with the `shift` tokens after the prefix
    dropped and the rest's keys turned by its rotary at position -shift (what a shifted copy holds)."""
    from transformers import DynamicCache, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = LlamaForCausalLM(loaded.config)
    hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    hf.eval()
    with torch.no_grad():
        full = hf(torch.tensor([before]), use_cache=True).past_key_values
        cache = DynamicCache()
        for layer in range(loaded.config.num_hidden_layers):
            k, v = full.layers[layer].keys, full.layers[layer].values  # [1, H, T, D], keys turned at 0..T-1
            kept_k = k[:, :, prefix + shift :]
            cos, sin = hf.model.rotary_emb(kept_k, torch.full((1, kept_k.shape[2]), -shift))
            kept_k, _ = apply_rotary_pos_emb(kept_k, kept_k, cos, sin)
            cache.update(torch.cat([k[:, :, :prefix], kept_k], 2),
                         torch.cat([v[:, :, :prefix], v[:, :, prefix + shift :]], 2), layer)
        start = len(before) - shift
        return hf(torch.tensor([rest]), cache=cache,
                  position_ids=torch.arange(start, start + len(rest))[None]).logits[0, -1]


def test_a_shifted_copy_answers_as_transformers_on_its_cache_with_the_cut_dropped_and_keys_turned(tiny_model):
    """`method="shift"`: the retained lines keep the cells the session computed, keys turned to their new
    positions, no forward pass. The reference is transformers' own cache of the same history with the cut
    lines dropped and the rest's keys turned by transformers' rotary at position -shift; the line pushed
    with the compaction and the question then run on it from their new positions."""
    eng = Engine(tiny_model, SHIFTING)
    try:
        eng.open_session("s")
        s = eng.sessions["s"]
        pushed = 0
        while not s.compactions:
            before = list(s.token_ids)  # all computed: each push is waited for
            eng.push("s", LINES[pushed : pushed + 3])
            pushed += 3
            eng.wait_idle()
        stats = eng.stats()
        assert s.compactions == 1 and stats["compaction_tokens"] == 0 and stats["compaction_tokens_shifted"] > 0
        got = eng.ask("s", "Trend?", max_tokens=1, return_logits=True).logits
        prefix, shift = s.prefix_len, s.tokens_dropped
        kept = len(before) - prefix - shift  # tokens of `before` the copy moved
        assert shift > 0 and s.token_ids[: prefix + kept] == before[:prefix] + before[prefix + shift :]
        later = s.token_ids[prefix + kept :]  # the line pushed with the compaction
        eng.check_integrity()
    finally:
        eng.shutdown()
    want = shifted_reference(tiny_model, before, prefix, shift, later + eng.layout.question_ids("Trend?"))
    assert (got - want).abs().max().item() <= 1e-4


def test_a_long_shift_moves_a_chunk_a_turn_and_answers_the_same(tiny_model, monkeypatch):
    """A shifting copy moves SHIFT_CHUNK cells a turn between steps (a long one never holds the core), and
    the session it swaps in is the same as one moved at once."""
    from streamllm.engine import compacting

    monkeypatch.setattr(compacting, "SHIFT_CHUNK", 16)
    late = CompactionPolicy(compact_at=0.99, retain=0.5)  # no copy of its own: the test starts one
    eng = Engine(tiny_model, dataclasses.replace(SHIFTING, compaction=late))
    try:
        eng.open_session("s")
        pushed = 0
        while eng.session_info("s").num_tokens < 0.7 * 640:
            eng.push("s", LINES[pushed : pushed + 3])
            pushed += 3
            eng.wait_idle()
        s = eng.sessions["s"]
        before = list(s.token_ids)

        def start(core):
            session = core.sessions["s"]
            started = core.compactor.start(session, core.compactor.policy.keep_tokens(session))
            return started, core.compactor.tokens_shifted  # none moved before this copy

        assert eng.call(start) == (True, 16)  # one chunk at once, the rest a chunk a turn
        assert eng.wait_idle(timeout=30)
        stats = eng.stats()
        prefix, shift = s.prefix_len, s.tokens_dropped
        assert s.compactions == 1 and stats["compaction_tokens"] == 0
        assert stats["compaction_tokens_shifted"] == len(before) - prefix - shift > 16
        assert s.token_ids == before[:prefix] + before[prefix + shift :]
        got = eng.ask("s", "Trend?", max_tokens=1, return_logits=True).logits
        eng.check_integrity()
    finally:
        eng.shutdown()
    want = shifted_reference(tiny_model, before, prefix, shift, eng.layout.question_ids("Trend?"))
    assert (got - want).abs().max().item() <= 1e-4


def test_questions_are_answered_while_a_compaction_runs(engine):
    engine.open_session("s")
    pushed = 0
    answers = []
    while engine.stats()["compactions_running"] == 0:
        engine.push("s", LINES[pushed : pushed + 2])
        pushed += 2
        engine.wait_idle(0)  # do not wait: let compaction start while we ask
        answers.append(engine.ask("s", "Trend?", max_tokens=2, timeout=30))
    answers.append(engine.ask("s", "Trend?", max_tokens=2, timeout=30))
    engine.wait_idle()
    assert engine.sessions["s"].compactions >= 1
    assert [a.data_version for a in answers] == sorted(a.data_version for a in answers)
    engine.check_integrity()


def test_closing_a_session_mid_compaction_frees_everything(engine):
    """A copy is in flight for a few steps only (it shares the prefix and copies what the session
    computed): each try checks for it and closes in back-to-back commands (no step between them
    unless the core drains them apart), until one close lands mid-copy."""
    from streamllm.engine.commands import Call

    free = engine.store.manager.num_free_blocks
    mid_copy = 0
    for attempt in range(10):
        engine.open_session("s")
        i = 0
        while engine.call(lambda core: not core.compactor.copies) and i < 4000:  # until a copy is in flight
            engine.push("s", LINES[i % 396 : i % 396 + 4])
            i += 4
            info = engine.session_info("s")  # ingested before the next push: the copy has data to copy
            while info.data_version < info.pushed_version and engine.call(lambda core: not core.compactor.copies):
                info = engine.session_info("s")
        in_flight = engine.core.submit(Call(lambda core: bool(core.compactor.copies)))
        engine.close_session("s")
        mid_copy += in_flight.result()
        engine.wait_idle()
        assert engine.store.manager.num_free_blocks == free, f"try {attempt}"
        engine.check_integrity()
        if mid_copy:
            break
    assert mid_copy


def test_a_steady_stream_of_three_budgets_is_never_refused_and_keeps_answering(tiny_model):
    """Pushed at a steady rate for 3x max_context, without waiting for ingest: no push refused,
    compaction keeps the session inside its budget, questions keep being answered throughout."""
    import time

    with Engine(tiny_model, EngineConfig(max_cells=16384, block_size=8, max_context=400, check_integrity_every_step=True, scheduler=SchedulerConfig(chunk_tokens=32, step_tokens=64))) as eng:
        eng.open_session("s")
        eng.register("s", QuestionSpec("q", "Up or down?", choices=("up", "down"), threshold=0.5, max_tokens=2))
        per_line = len(eng.layout.lines_ids(LINES[:1])[0])
        target = 3 * 400 // per_line + 1
        answers, i = [], 0
        while i < target:
            ack = eng.push("s", LINES[i % len(LINES) : i % len(LINES) + 2])  # raises if refused
            assert ack.data_version == i // 2 + 1
            i += 2
            time.sleep(0.004)  # ~500 lines/s: a steady feed, no wait for ingest
            if i % 20 == 0:
                answers.append(eng.ask("s", "q", timeout=30))
        assert eng.wait_idle(timeout=120)
        info = eng.session_info("s")
        assert info.data_version == info.pushed_version == (i + 1) // 2
        assert info.compactions >= 2 and info.num_tokens <= 400
        assert all(a.text in ("up", "down") for a in answers)
        assert eng.stats()["failed_steps"] == 0


def test_many_sessions_at_budget_in_a_tight_pool_all_get_through(tiny_model):
    """Found by the tenants bench: 16 sessions compacting at once in a nearly full pool left every
    copy half built, every session at its budget and nothing moving. Copies now start only when
    the pool can hold them, and a blocked copy takes idle entries' cells first."""
    sessions, max_context = 6, 320
    with Engine(tiny_model, EngineConfig(max_cells=sessions * max_context + 512, block_size=8, max_context=max_context, branch_cells=256, check_integrity_every_step=True, scheduler=SchedulerConfig(chunk_tokens=64, step_tokens=128))) as eng:
        for k in range(sessions):
            eng.open_session(f"s{k}")
            eng.register(f"s{k}", QuestionSpec("q", "Up or down?", choices=("up", "down"), threshold=0.5))
        for i in range(0, 3 * max_context // 8, 2):  # ~3 budgets each, no waiting
            for k in range(sessions):
                eng.push(f"s{k}", LINES[i % 300 : i % 300 + 2])
        if not eng.wait_idle(timeout=90):
            raise AssertionError("sessions stuck at their budget:\n" + eng.call(_dump))
        for k in range(sessions):
            info = eng.session_info(f"s{k}")
            assert info.data_version == info.pushed_version and info.compactions >= 1
            assert eng.ask(f"s{k}", "q", timeout=60).text in ("up", "down")


def _dump(core) -> str:
    m = core.store.manager
    out = [f"free {m.num_free_blocks * m.block_size} reserved {m.num_reserved * m.block_size} "
           f"running {len(core.answerer.running)} waiting {len(core.answerer.waiting)} {core.counters}"]
    for s in core.sessions.values():
        c = core.compactor.copies.get(s.name)
        out.append(f"{s.name} tokens {s.num_tokens} computed {s.num_computed} at_budget {s.at_budget} "
                   f"blocks {len(s.table.blocks)} reserved {len(s.table.reserved)} pending {len(s.pending_ids)} "
                   f"copy {c and (c.num_computed, len(c.pending_ids), c.cells_to_go(), c.session_computed_mapped())}")
    for st in core.prepos.all():
        out.append(f"  {st.session.name} computing {st.computing and (st.computing.num_computed, st.computing.table.num_tokens)} "
                   f"ready {st.ready is not None} decoding {st.decoding is not None}")
    return "\n".join(out)


def test_a_fast_feed_starts_no_copy_that_would_free_almost_nothing():
    """Under a feed faster than a copy, a copy used to start as soon as a session passed `retain`:
    it recomputed half the budget to free one line, and every swap started the next (daily bars
    replayed flat out spent 15 s a bar on copies). Early starts wait until a copy frees a share."""
    from streamllm.engine.compaction import CompactionPolicy
    from streamllm.engine.kv import BlockTable
    from streamllm.engine.sequence import Session

    policy = CompactionPolicy(compact_at=0.75, retain=0.5, method="recompute")
    session = Session("s", "sys", [1] * 20, 1000, BlockTable())

    def push_lines(count: int, start_s: float) -> None:
        for i in range(count):
            session.append_batch([[7] * 10], now=start_s + i * 0.05)  # 200 tokens/s

    push_lines(50, 0.0)  # 520 tokens: just past retain, and filling faster than a copy can run
    assert session.push_rate() > 0
    assert not policy.should_start(session, copy_tokens_per_s=50.0)
    push_lines(11, 2.5)  # 630: past halfway from retain to compact_at, the early start may go
    assert policy.should_start(session, copy_tokens_per_s=50.0)
    # a shifted copy is made between two steps: it never needs to start before compact_at
    assert not CompactionPolicy(compact_at=0.75, retain=0.5).should_start(session, copy_tokens_per_s=50.0)
    cut = session.compaction_cut(policy.keep_tokens(session))
    freed = cut - session.prefix_len
    assert freed >= (policy.compact_at - policy.retain) / 2 * session.max_context
    assert not policy.should_start(session, copy_tokens_per_s=1e9)  # a fast copy still waits for compact_at
    push_lines(12, 3.1)  # 750: at compact_at a copy starts whatever the rates
    assert policy.should_start(session, copy_tokens_per_s=1e9)
