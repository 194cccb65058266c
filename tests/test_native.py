"""The native decode step (streamllm/model/native.py) against the Python forward it replaces and
an fp32 reference: as close to the reference as the Python bf16 forward, the same cells written,
the same taps, over sequences whose cells lie in several runs; and the Python forward wherever the
native step cannot be had.

Both bf16 forwards round the same values, in other orders (sums, the attention's softmax), so
they differ by a few bf16 roundings: each is held to its distance from the fp32 reference."""

from __future__ import annotations

import copy

import pytest
import torch

from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model import int4, native
from streamllm.model.attention import SeqAttention
from streamllm.model.llama import ForwardBatch, LlamaForward
from tests.test_int4 import q4_model

pytestmark = pytest.mark.skipif(not int4.available(torch.device("cpu"), torch.bfloat16) or native.load() is None,
                                reason="no CPU 4-bit kernels or no C++ compiler here")


def models(config, weights) -> tuple[LlamaForward, LlamaForward, LlamaForward]:
    """(native, Python bf16, fp32 reference) over the same 4-bit weights."""
    kw = dict(dtype="bfloat16", fp32_rows=0, int4_rows=4)
    return (LlamaForward(config, weights, native_decode=True, **kw),
            LlamaForward(config, weights, native_decode=False, **kw), LlamaForward(config, weights, dtype="float32"))


def assert_close(native_out: torch.Tensor, python_out: torch.Tensor, reference: torch.Tensor) -> None:
    """The native step is as near the fp32 reference as the Python bf16 forward (a wrong cell, run or
    rotation is off by the logits' own size)."""
    python_error = (python_out - reference).abs().max()
    assert (native_out - reference).abs().max() <= 1.5 * python_error + 0.01 * reference.abs().max()


def run_all(trio: tuple[LlamaForward, ...], ids: list[int], runs_of, steps: int = 4, **kw):
    """Prefill ids (the Python forward), then `steps` one-token steps, on each model with a pool of its
    own, the sequence's cells laid out by runs_of(keys) -> [(pos0, slot0, n)]: (per-step outputs, pool)
    for each model."""
    got = []
    for model in trio:
        pool = KVPool(model.num_layers, 512, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype)
        pool.k.zero_()
        pool.v.zero_()

        def batch(tokens: list[int], pos0: int) -> ForwardBatch:
            runs = runs_of(pos0 + len(tokens))
            slots = [slot0 + i for p0, slot0, n in runs for i in range(n) if p0 + i >= pos0]
            return ForwardBatch(torch.tensor(tokens), torch.arange(pos0, pos0 + len(tokens)), torch.tensor(slots),
                                [SeqAttention(0, len(tokens), pos0, runs)], torch.tensor([len(tokens) - 1]))

        trio[-1 if model.dtype == torch.float32 else 1].forward(batch(ids, 0), pool.k, pool.v)
        outs = [model.forward(batch([7 + i], len(ids) + i), pool.k, pool.v, **kw) for i in range(steps)]
        got.append((outs, pool))
    return got


def scattered(keys: int) -> list[tuple[int, int, int]]:
    """A branch's layout: runs of 16 cells in a scattered order (block i in cells 16 * (13 i mod 31)),
    the last one partly used."""
    return [(16 * i, 16 * (13 * i % 31), min(16, keys - 16 * i)) for i in range(-(-keys // 16))]


@pytest.mark.parametrize("runs_of", [lambda keys: [(0, 40, keys)], scattered], ids=["one run", "scattered runs"])
@pytest.mark.parametrize("context", [65, 400], ids=["short", "long"])  # long: a kv head's keys in slices
def test_native_step_matches_the_python_forward(tiny_model, runs_of, context):
    trio = models(tiny_model.config, q4_model(tiny_model))
    assert trio[0].native_decode and not trio[1].native_decode
    (fast_out, fast_pool), (slow_out, slow_pool), (ref_out, _) = run_all(trio, list(range(5, 5 + context)), runs_of)
    for a, b, r in zip(fast_out, slow_out, ref_out, strict=True):
        assert_close(a, b, r)
    # the cells the steps wrote: the same keys and values, within a few bf16 roundings
    for a, b in ((fast_pool.k, slow_pool.k), (fast_pool.v, slow_pool.v)):
        assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()


def test_native_step_returns_the_taps_and_hidden_states_of_the_python_forward(tiny_model):
    trio = models(tiny_model.config, q4_model(tiny_model))
    for tap, stop in ((0, False), (1, False), (1, True), (2, False)):
        kw = dict(tap_layer=tap, stop_at_tap=stop, return_hidden=not stop)
        (fast_out, _), (slow_out, _), (ref_out, _) = run_all(trio, list(range(5, 40)), scattered, steps=2, **kw)
        for a, b, r in zip(fast_out, slow_out, ref_out, strict=True):
            assert_close(a.tap, b.tap, r.tap)
            if stop:
                assert a.logits is None and a.hidden is None
            else:
                assert_close(a.hidden, b.hidden, r.hidden)
                assert_close(a.logits, b.logits, r.logits)


@pytest.mark.parametrize("head_dim", [24, 32, 64], ids=["portable loop", "32", "64"])
def test_every_head_size_agrees(tiny_model, head_dim):
    """The vector kernels cover head sizes 16 to 128 (from 32 on, with AVX512-BF16, in bf16 pairs), a
    portable loop the others (24); tiny's own is 16."""
    config = copy.deepcopy(tiny_model.config)
    config.head_dim = head_dim
    gen = torch.Generator().manual_seed(1)
    weights = dict(tiny_model.state_dict)
    h, nh, nkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for name, shape in (("q_proj", (nh * d, h)), ("k_proj", (nkv * d, h)), ("v_proj", (nkv * d, h)),
                            ("o_proj", (h, nh * d))):
            weights[p + name + ".weight"] = torch.randn(shape, generator=gen) * 0.05
    trio = models(config, q4_model(type("M", (), {"state_dict": weights})()))
    assert trio[0].native_decode
    (fast_out, _), (slow_out, _), (ref_out, _) = run_all(trio, list(range(5, 300)), scattered)  # odd runs, slices
    for a, b, r in zip(fast_out, slow_out, ref_out, strict=True):
        assert_close(a, b, r)


def test_steps_of_one_token_a_sequence_run_natively_and_others_in_python(tiny_model, monkeypatch):
    fast = models(tiny_model.config, q4_model(tiny_model))[0]
    calls = []
    step = fast._decode_step
    monkeypatch.setattr(fast, "_decode_step", type("Spy", (), {"run": lambda self, *a: calls.append(a) or step.run(*a)})())
    pool = KVPool(fast.num_layers, 256, fast.num_kv_heads, fast.head_dim, dtype=fast.kv_dtype)
    runner = Runner(fast, KVStore(BlockManager(16, 16), pool))
    a, b = BlockTable(), BlockTable()
    runner.store.manager.append(a, 40)
    runner.store.manager.append(b, 40)
    runner.execute([Work(a, list(range(5, 35)), 0, "last"), Work(b, list(range(5, 35)), 0, "last")])
    assert not calls  # many rows a sequence
    runner.execute([Work(a, [7], 30, "last"), Work(b, [8, 9], 30, "last")])
    assert not calls  # one sequence of two tokens
    runner.execute([Work(a, [9], 31, "last")])
    runner.execute([Work(a, [9], 32, "last"), Work(b, [9], 32, "last")])
    assert [len(call[5]) for call in calls] == [1, 2]  # slots: one sequence, then two


@pytest.mark.parametrize("sequences", [3, 6], ids=["4-bit products", "packed bf16 products"])  # int4_rows = 4
def test_a_batch_of_sequences_decodes_natively_as_in_python(tiny_model, sequences):
    """Sequences of different lengths in one step, each in runs of its own, against the Python batched
    step and the fp32 reference."""
    trio = models(tiny_model.config, q4_model(tiny_model))
    lengths = [20 + 37 * i for i in range(sequences)]
    got = []
    for model in trio:
        pool = KVPool(model.num_layers, 2048, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype)
        runner = Runner(model, KVStore(BlockManager(128, 16), pool))
        tables = [BlockTable() for _ in lengths]
        for table, n in zip(tables, lengths, strict=True):
            runner.store.manager.append(table, n + 3)
            runner.execute([Work(table, list(range(5, 5 + n)), 0, "last")])
        outs = []
        for step in range(3):
            outs.append(runner.execute([Work(t, [9 + i + step], n + step, "last")
                                        for i, (t, n) in enumerate(zip(tables, lengths, strict=True))]))
        got.append(outs)
    for fast_step, slow_step, ref_step in zip(*got, strict=True):  # each step's rows together: the max of six
        assert_close(torch.stack(fast_step), torch.stack(slow_step), torch.stack(ref_step))


def test_without_the_native_step_the_python_forward_decodes(tiny_model, monkeypatch):
    monkeypatch.setenv("STREAMLLM_NATIVE", "0")
    assert native.load() is None
    model = LlamaForward(tiny_model.config, q4_model(tiny_model), dtype="bfloat16", fp32_rows=0, int4_rows=4)
    assert not model.native_decode


def test_a_failed_build_leaves_the_python_forward(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(**kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level("WARNING"):
        assert native._build("streamllm_decode_test_failure") is None
    assert "no compiler here" in caplog.text


def test_sequences_sharing_most_of_their_keys_keep_the_python_cascade(tiny_model):
    """Entries forked off one session share a first run of most of their keys: Python's cascade reads it
    once for all. A short shared run (a system prompt) does not hold a step back from the native one."""
    fast = models(tiny_model.config, q4_model(tiny_model))[0]

    def batch(shared: int) -> ForwardBatch:
        seqs = [SeqAttention(b, 1, 99, [(0, 0, shared), (shared, 200 + 100 * b, 100 - shared)]) for b in range(2)]
        return ForwardBatch(torch.tensor([7, 8]), torch.tensor([99, 99]), torch.tensor([299, 399]), seqs,
                            torch.tensor([0, 1]), groups=[(((0, 0, shared),), [0, 1])])

    assert fast._native_runs(batch(32)) is not None
    assert fast._native_runs(batch(60)) is None


def test_a_run_outside_the_pool_is_refused_not_read(tiny_model):
    fast = models(tiny_model.config, q4_model(tiny_model))[0]
    pool = KVPool(fast.num_layers, 64, fast.num_kv_heads, fast.head_dim, dtype=fast.kv_dtype)
    h = torch.zeros(1, tiny_model.config.hidden_size)
    cos, sin = fast._cos[:1], fast._sin_signed[:1]
    with pytest.raises(RuntimeError, match="outside the pool"):
        fast._decode_step.run(h, cos, sin, pool.k, pool.v, [10], [0, 60, 60, 8], [0, 2], 0, fast.num_layers)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fast._decode_step.run(h, cos, sin, pool.k, pool.v, [64], [0, 11], [0, 1], 0, fast.num_layers)


def test_the_engine_decodes_answers_natively(tiny_model, monkeypatch):
    """Through the engine: an ad-hoc answer's decode steps (one token a step) are native steps, and the
    answer is the one the Python forward decodes from the same first token on."""
    from streamllm.engine import Engine, EngineConfig
    from streamllm.model.checkpoint import LoadedModel

    # the engine times its 4-bit crossover at load; on a busy machine a kind may lose it: fixed here
    monkeypatch.setattr(int4, "int4_crossover", lambda copies, linear: dict.fromkeys(copies, 4))

    q4 = LoadedModel(tiny_model.name, tiny_model.config, q4_model(tiny_model), tiny_model.tokenizer, tiny_model.source)
    answers, steps = [], []
    for native_on in (True, False):
        engine = Engine(q4, EngineConfig(max_cells=2048, max_context=512), dtype="bfloat16")
        try:
            assert engine.model.native_decode and engine.stats()["native_decode"] == 1  # /health and /metrics say so
            if not native_on:
                engine.call(lambda core: setattr(core.runner.model, "_decode_step", None))
            real = engine.model._decode_step
            calls = []
            if native_on:
                spy = type("Spy", (), {"run": lambda self, *a, calls=calls, real=real: calls.append(a) or real.run(*a)})()
                engine.call(lambda core, spy=spy: setattr(core.runner.model, "_decode_step", spy))
            engine.open_session("s")
            engine.push("s", [f"00:{i:02d} 100{i} +{i} v1.{i}M" for i in range(12)])
            engine.wait_idle()  # the ask's steps alone (a step with a line to ingest runs in Python)
            answers.append(engine.ask("s", "What happened?", max_tokens=6).tokens)
            steps.append(len(calls))
        finally:
            engine.shutdown()
    assert len(answers[0]) == 6 and answers[0][0] == answers[1][0]  # the first comes from the question's prefill
    assert steps == [5, 0]  # every token after the first is a native step


def test_a_model_home_it_cannot_write_leaves_the_python_forward(tmp_path, monkeypatch, caplog):
    home = tmp_path / "home"
    home.write_text("a file where the model home's folder would be")
    monkeypatch.setenv("STREAMLLM_HOME", str(home))
    with caplog.at_level("WARNING"):
        assert native._build("streamllm_decode_test_home") is None
    assert "decoding in Python" in caplog.text
