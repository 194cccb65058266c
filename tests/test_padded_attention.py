"""Padded groups: many sequences of one step attended in one call give each sequence's own result."""

from __future__ import annotations

import pytest
import torch

from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model.attention import SeqAttention, attend_padded, plan_padded
from streamllm.model.llama import LlamaForward

BLOCK = 8


def dense(q, k_layer, v_layer, seq: SeqAttention, scale: float) -> torch.Tensor:
    """Causal attention over the sequence's keys gathered in position order: [q_len, Hq, D]."""
    hkv, _, d = k_layer.shape
    g = q.shape[1] // hkv
    slots = torch.cat([torch.arange(s0, s0 + n) for _, s0, n in seq.runs])
    keys, vals = k_layer[:, slots].repeat_interleave(g, 0), v_layer[:, slots].repeat_interleave(g, 0)
    qs = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)  # [Hq, n, D]
    keep = torch.arange(slots.numel())[None, :] <= torch.arange(seq.q_pos0, seq.q_pos0 + seq.q_len)[:, None]
    scores = (qs @ keys.transpose(1, 2) * scale).masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) @ vals).transpose(0, 1)


def test_a_padded_group_equals_dense_attention_per_sequence():
    gen = torch.Generator().manual_seed(7)
    hkv, g, d, slots = 2, 3, 8, 40 * BLOCK
    k_layer, v_layer = torch.randn(hkv, slots, d, generator=gen), torch.randn(hkv, slots, d, generator=gen)
    unwritten = torch.ones(slots, dtype=torch.bool)  # cells no run holds: NaN bits, as never-written cells may be
    # (q_len, runs): one run, a branch's two runs, three scattered runs, new tokens over a block edge
    shapes = [
        (1, [(0, 0, 13)]),
        (2, [(0, 80, 16), (16, 40, 5)]),
        (7, [(0, 160, 8), (8, 24, 8), (16, 200, 6)]),
        (13, [(0, 256, 24), (24, 120, 11)]),
    ]
    seqs, row = [], 0
    for q_len, runs in shapes:
        for _, s0, n in runs:
            unwritten[s0 : s0 + n] = False
        total = sum(n for _, _, n in runs)
        seqs.append(SeqAttention(row, q_len, total - q_len, runs))
        row += q_len
    k_layer[:, unwritten], v_layer[:, unwritten] = float("nan"), float("nan")
    q = torch.randn(row, hkv * g, d, generator=gen)
    (group,) = plan_padded(seqs, g, q.dtype, q.device, BLOCK)
    assert sorted(group.members) == [0, 1, 2, 3]
    out = attend_padded(q, k_layer, v_layer, group, 0.3)
    got = torch.empty(row, hkv * g, d)
    got[group.rows] = out
    for seq in seqs:
        ref = dense(q, k_layer, v_layer, seq, 0.3)
        assert (got[seq.q_start : seq.q_start + seq.q_len] - ref).abs().max().item() <= 1e-5


def test_padding_stays_within_its_bounds():
    def seq(q_len: int, keys: int) -> SeqAttention:
        return SeqAttention(0, q_len, keys - q_len, [(0, 0, keys)])

    short = [seq(1, 16), seq(2, 24), seq(1, 20)]
    chunk = seq(40, 2000)
    groups = plan_padded([*short, chunk], 3, torch.float32, "cpu", BLOCK)
    assert [sorted(gr.members) for gr in groups] == [[0, 1, 2]]  # the chunk would pad the rest 40 x 100-fold
    # without slack, the 2-token one would double the queries of the others (16 and 24 keys: 2 and 3 blocks)
    assert [sorted(gr.members) for gr in plan_padded(short, 3, torch.float32, "cpu", BLOCK, slack=0)] == [[0, 2]]
    assert plan_padded([*short, chunk], 3, torch.float32, "cpu", BLOCK, max_keys=16) == []  # one left: nothing to group
    assert plan_padded(short, 3, torch.float32, "cpu", BLOCK, skip={0, 1}) == []  # one left: nothing to group
    unaligned = SeqAttention(0, 1, 15, [(0, 0, 8), (8, 44, 8)])  # a run starting mid-block cannot be gathered by block
    (group,) = plan_padded([*short, unaligned], 3, torch.float32, "cpu", BLOCK)
    assert 3 not in group.members


def sessions_and_works(runner: Runner, gen: torch.Generator) -> tuple[list[BlockTable], list[Work]]:
    """Five sessions prefilled in interleaved chunks (their blocks interleave: several runs each), then
    a step of ragged work on them: decode-like branches, a prefill chunk, a question."""
    manager = runner.store.manager
    lengths = [37, 61, 22, 90, 50]
    ids = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in lengths]
    tables = [BlockTable() for _ in lengths]
    for start in range(0, max(lengths), 20):  # one step per round of chunks: padded prefill under causal masks
        step = []
        for t, s in zip(tables, ids, strict=True):
            if start < len(s):
                n = min(20, len(s) - start)
                manager.append(t, n)
                step.append(Work(t, s[start : start + n], start, "none"))
        runner.execute(step)
    works = []
    for i, q_len in enumerate([1, 2, 7, 13, 1]):
        table = tables[i] if i == 2 else runner.store.fork(tables[i])  # session 2 extends itself
        manager.append(table, q_len)
        works.append(Work(table, torch.randint(0, 200, (q_len,), generator=gen).tolist(), lengths[i], "all"))
    return tables, works


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_a_ragged_batch_answers_as_each_sequence_alone(tiny_model, dtype, tol):
    model = LlamaForward(tiny_model.config, tiny_model.state_dict, dtype=dtype, fp32_rows=0)
    pool = KVPool(model.num_layers, 256 * BLOCK, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype)
    pool.k.fill_(float("nan")), pool.v.fill_(float("nan"))  # what never-written cells may hold
    runner = Runner(model, KVStore(BlockManager(256, BLOCK), pool))
    _, works = sessions_and_works(runner, torch.Generator().manual_seed(8))
    batch, _ = runner.build_batch(works)
    groups = plan_padded(batch.seqs, model.groups, model.dtype, "cpu", batch.block_size)
    assert sorted(i for gr in groups for i in gr.members) == [0, 1, 2, 3, 4]  # every sequence in a padded group
    assert max(len(s.runs) for s in batch.seqs) >= 3
    alone = [runner.execute([w])[0] for w in works]
    together = runner.execute(works)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    model.pad_batch = False  # the per-sequence path, same step: the reference the groups replace
    for a, b in zip(runner.execute(works), together, strict=True):
        assert (a - b).abs().max().item() <= tol
