"""4-bit copies of weights already on a Q4 grid (streamllm/model/int4.py): exact packing, the
same products as the bf16 weights within bf16 rounding, and never a copy of weights off the grid."""

from __future__ import annotations

import pytest
import torch

from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model import int4
from streamllm.model.llama import LlamaForward

pytestmark = pytest.mark.skipif(not int4.available(torch.device("cpu"), torch.bfloat16),
                                reason="this torch has no CPU 4-bit kernels")


def on_q4_grid(weight: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """What a Q4_1 GGUF dequantizes to: per block of 32 inputs, d * q + m with q in 0..15."""
    gen = torch.Generator().manual_seed(seed)
    out_f, in_f = weight.shape
    blocks = weight.reshape(out_f, in_f // int4.GROUP, int4.GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()  # GGUF keeps d and m in fp16
    low = low.half().float()
    q = torch.randint(0, 16, blocks.shape, generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # every block spans its range, as quantizing makes it
    return (q * d + low).reshape(out_f, in_f)


def test_a_weight_on_the_grid_packs_exactly_and_multiplies_like_bf16():
    weight = on_q4_grid(torch.randn(96, 128) * 0.05)
    q, d, low = int4.q4_grid(weight)
    assert q.min() >= 0 and q.max() <= 15
    assert torch.equal(q.reshape(96, 4, 32).float() * d[..., None] + low[..., None], weight.reshape(96, 4, 32))
    packed = int4.pack(weight)
    x = torch.randn(3, 128)
    ref = x @ weight.t()
    got = int4.linear(x, packed).float()
    bf16 = (x.bfloat16() @ weight.bfloat16().t()).float()
    assert got.shape == (3, 96)
    # 4-bit copy and bf16 weight round the same values differently, by about as much
    assert (got - ref).abs().max() <= 4 * (bf16 - ref).abs().max() + 1e-3


def test_weights_off_the_grid_get_no_copy():
    assert int4.q4_grid(torch.randn(64, 64)) is None
    assert int4.pack(torch.randn(64, 64)) is None
    assert int4.q4_grid(torch.randn(64, 48)) is None  # inputs not a whole number of blocks


def q4_model(tiny_model) -> dict[str, torch.Tensor]:
    weights = dict(tiny_model.state_dict)
    for i, (name, w) in enumerate(sorted(weights.items())):
        if name.startswith("model.layers.") and w.dim() == 2:
            weights[name] = on_q4_grid(w.float(), seed=i)
    return weights


def decode_logits(model: LlamaForward, ids: list[int]) -> torch.Tensor:
    """Prefill all but the last 3 tokens, then one token per step: logits of the single-token steps."""
    pool = KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype)
    runner = Runner(model, KVStore(BlockManager(16, 16), pool))
    table = BlockTable()
    runner.store.manager.append(table, len(ids))
    runner.execute([Work(table, ids[:-3], 0, "last")])
    return torch.cat([runner.execute([Work(table, [t], len(ids) - 3 + i, "last")])[0]
                      for i, t in enumerate(ids[-3:])])


def test_decode_from_4_bit_copies_matches_the_bf16_weights(tiny_model):
    weights = q4_model(tiny_model)
    four = LlamaForward(tiny_model.config, weights, dtype="bfloat16", fp32_rows=0, int4_rows=4,
                        native_decode=False)  # the Python forward's 4-bit products (native: test_native.py)
    plain = LlamaForward(tiny_model.config, weights, dtype="bfloat16", fp32_rows=0, int4_rows=0)
    reference = LlamaForward(tiny_model.config, weights, dtype="float32")
    assert four.int4_rows == {"qkv": 4, "o": 4, "gate_up": 4, "down": 4, "lm_head": 0}
    assert plain.int4_rows == dict.fromkeys(four.int4_rows, 0)
    assert four.weight_bytes > plain.weight_bytes
    ids = list(range(5, 45))
    ref, got, bf16 = decode_logits(reference, ids), decode_logits(four, ids), decode_logits(plain, ids)
    assert (got - ref).abs().max() <= max(0.15, 3 * (bf16 - ref).abs().max())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_checkpoint_off_the_grid_keeps_its_bf16_path(tiny_model):
    model = LlamaForward(tiny_model.config, tiny_model.state_dict, dtype="bfloat16", fp32_rows=0)
    assert set(model.int4_rows.values()) == {0} and not model._w4


def test_an_fp32_model_chosen_by_auto_decodes_from_low_precision_copies(tiny_model, monkeypatch):
    """On a CPU without fast bf16, "auto" runs fp32: its few-row steps read the 4-bit copies (inputs rounded to
    bf16) and a bf16 lm_head, within bf16's distance of fp32; longer steps stay fp32 (on oneDNN-packed weights
    where it packs, within fp32 rounding). Asked for fp32 by name, the model keeps no copies: the reference."""
    import streamllm.model.llama as llama
    from streamllm.model.dtype import DtypeChoice

    weights = q4_model(tiny_model)
    reference = LlamaForward(tiny_model.config, weights, dtype="float32", int4_rows=4, bf16_rows=4)  # asked for
    assert not reference._w4 and not reference._w16 and not reference._packed and reference.is_reference
    assert set(reference.int4_rows.values()) == set(reference.bf16_rows.values()) == {0}
    plain_bf16 = LlamaForward(tiny_model.config, weights, dtype="bfloat16", fp32_rows=0, int4_rows=0)
    monkeypatch.setattr(llama, "resolve_dtype",
                        lambda spec, device: DtypeChoice(torch.float32, "auto", "float32 (auto: no fast bf16)"))
    auto = LlamaForward(tiny_model.config, weights, dtype="auto", int4_rows=4, bf16_rows=4)
    assert auto.dtype == torch.float32 and not auto.native_decode  # the native step is bf16 only
    assert auto.int4_decode and not reference.int4_decode
    assert auto.int4_rows == {"qkv": 4, "o": 4, "gate_up": 4, "down": 4, "lm_head": 0}
    assert auto.bf16_rows == {"qkv": 0, "o": 0, "gate_up": 0, "down": 0, "lm_head": 4}  # no 4-bit copy of its own
    assert auto.weight_bytes > reference.weight_bytes
    ids = list(range(5, 45))
    ref, got, bf16 = decode_logits(reference, ids), decode_logits(auto, ids), decode_logits(plain_bf16, ids)
    assert got.dtype == torch.float32
    assert 0 < (got - ref).abs().max() <= max(0.15, 3 * (bf16 - ref).abs().max())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    prefill = []
    for model in (reference, auto):  # 37 rows: past every copy's row count
        pool = KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype)
        runner, table = Runner(model, KVStore(BlockManager(16, 16), pool)), BlockTable()
        runner.store.manager.append(table, 37)
        prefill.append(runner.execute([Work(table, ids[:37], 0, "all")])[0])
    assert (prefill[0] - prefill[1]).abs().max() <= 1e-4
