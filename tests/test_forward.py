"""Our forward vs transformers' forward on the same weights (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model.llama import LlamaForward

TOL = 1e-4
COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
)


def build(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True, **extra))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False, **extra))
    else:
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None, **extra))
    # Bigger weights than the default init, so differences would show in the logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "bias" in str(p):
                p.normal_(0, 0.05)
    model.eval()
    return model


def make_runner(model, num_blocks=64, block_size=8):
    cfg = model.config
    ours = LlamaForward(cfg, model.state_dict())
    pool = KVPool(ours.num_layers, num_blocks * block_size, ours.num_kv_heads, ours.head_dim)
    return Runner(ours, KVStore(BlockManager(num_blocks, block_size), pool))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def prefill(runner, ids, chunks=None, table=None):
    table = table or BlockTable()
    chunks = chunks or [len(ids)]
    out, pos = [], table.num_tokens
    for n in chunks:
        runner.store.manager.append(table, n)
        (lg,) = runner.execute([Work(table, ids[pos : pos + n], pos, "all")])
        out.append(lg)
        pos += n
    return table, torch.cat(out)


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                        "rope_theta": 500000.0}}),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_prefill_matches_transformers(kind, extra):
    model = build(kind, **extra)
    ids = torch.randint(0, 300, (57,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = make_runner(model)
    _, ours = prefill(runner, ids)
    ref = hf_logits(model, ids)
    assert (ours - ref).abs().max().item() <= TOL


def test_chunked_prefill_and_decode_match_one_shot():
    model = build("llama")
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(model, ids)
    runner = make_runner(model)
    # chunk sizes that straddle block boundaries, then single-token decode steps
    _, ours = prefill(runner, ids, chunks=[5, 11, 1, 16, 30, 1, 1, 1, 1, 1, 1, 1])
    assert (ours - ref).abs().max().item() <= TOL


def test_ragged_batch_equals_solo():
    model = build("llama")
    runner = make_runner(model)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (13, 29, 8)]
    tables = [BlockTable() for _ in seqs]
    # first parts solo, then all remaining parts in one batched forward
    heads = [5, 17, 8]  # the third is complete: it sits this batch out
    for t, s, h in zip(tables, seqs, heads, strict=True):
        prefill(runner, s[:h], table=t)
    pending = [(t, s, h) for t, s, h in zip(tables, seqs, heads, strict=True) if h < len(s)]
    works = []
    for t, s, h in pending:
        runner.store.manager.append(t, len(s) - h)
        works.append(Work(t, s[h:], h, "all"))
    outs = runner.execute(works)
    assert len(outs) == 2
    for out, (_, s, h) in zip(outs, pending, strict=True):
        assert (out - hf_logits(model, s)[h:]).abs().max().item() <= TOL


def test_fork_branch_attends_across_runs():
    """A branch sees the session's shared blocks plus its own copied tail: two runs, LSE merge."""
    model = build("llama")
    runner = make_runner(model)
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(0, 300, (21,), generator=gen).tolist()  # 21 = 2 full blocks + partial
    question = torch.randint(0, 300, (6,), generator=gen).tolist()
    table, _ = prefill(runner, base)
    branch = runner.store.fork(table)
    runner.store.manager.append(branch, len(question))
    assert len(runner.store.manager.runs(branch)) >= 2
    (out,) = runner.execute([Work(branch, question, len(base), "all")])
    ref = hf_logits(model, base + question)[len(base):]
    assert (out - ref).abs().max().item() <= TOL
    runner.store.manager.check_integrity([table, branch])


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize(
    "runs",
    [
        [(0, 0, 12)],  # one contiguous run
        [(0, 40, 8), (8, 8, 4)],  # session blocks + branch tail
        [(0, 40, 8), (8, 8, 2), (10, 64, 2)],  # new tokens scattered over two runs
        [(0, 64, 4), (4, 16, 4), (8, 100, 4)],
    ],
)
def test_paged_attention_equals_dense(runs, q_len):
    """Every way of cutting a context into runs gives dense causal attention's result."""
    from streamllm.model.attention import SeqAttention, attend, plan_parts

    gen = torch.Generator().manual_seed(5)
    hkv, g, d, slots = 2, 3, 8, 128
    k_layer, v_layer = torch.randn(hkv, slots, d, generator=gen), torch.randn(hkv, slots, d, generator=gen)
    total = sum(n for _, _, n in runs)
    q_pos0 = total - q_len
    q = torch.randn(hkv, g * q_len, d, generator=gen)
    out = attend(q, k_layer, v_layer, plan_parts(SeqAttention(0, q_len, q_pos0, runs), g, q.dtype, q.device), 0.3)
    keys = torch.cat([k_layer[:, s : s + n] for _, s, n in runs], dim=1)
    vals = torch.cat([v_layer[:, s : s + n] for _, s, n in runs], dim=1)
    q_pos = torch.arange(q_pos0, total).repeat(g)
    mask = torch.arange(total)[None, :] <= q_pos[:, None]
    ref = torch.softmax((q @ keys.transpose(1, 2) * 0.3).masked_fill(~mask, float("-inf")), -1) @ vals
    assert (out - ref).abs().max().item() <= 1e-5


def test_grouped_prefill_of_entries_equals_each_alone():
    """Entries forked at one point read the shared prefix once (cascade): same logits as solo."""
    model = build("llama")
    runner = make_runner(model, num_blocks=128)
    gen = torch.Generator().manual_seed(6)
    base = torch.randint(0, 300, (45,), generator=gen).tolist()
    questions = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (7, 3, 12, 5)]
    table, _ = prefill(runner, base)
    branches = []
    for q in questions:
        br = runner.store.fork(table)
        runner.store.manager.append(br, len(q))
        branches.append(br)
    works = [Work(br, q, len(base), "all") for br, q in zip(branches, questions, strict=True)]
    batch, _ = runner.build_batch(works)
    assert len(batch.groups) == 1 and len(batch.groups[0][1]) == 4  # one shared run, four members
    grouped = runner.execute(works)
    for out, q in zip(grouped, questions, strict=True):
        ref = hf_logits(model, base + q)[len(base):]
        assert (out - ref).abs().max().item() <= TOL


def test_entries_of_sessions_sharing_a_system_prompt_block_group_per_session():
    """Sessions that share their first block (the prefix cache's system prompt) are not one cascade: each
    session's entries group on all the runs before their fork, and every logit is transformers'."""
    model = build("llama")
    runner = make_runner(model, num_blocks=256)
    gen = torch.Generator().manual_seed(9)
    system = torch.randint(0, 300, (32,), generator=gen).tolist()  # two whole blocks, shared by both sessions
    prefix, _ = prefill(runner, system)
    works, refs = [], []
    for _ in range(2):
        lines = torch.randint(0, 300, (40,), generator=gen).tolist()
        session = runner.store.fork(prefix)
        runner.store.manager.append(session, len(lines))
        runner.execute([Work(session, lines, len(system), "last")])
        for n in (7, 3, 12):
            question = torch.randint(0, 300, (n,), generator=gen).tolist()
            entry = runner.store.fork(session)
            runner.store.manager.append(entry, n)
            works.append(Work(entry, question, len(system) + len(lines), "all"))
            refs.append(hf_logits(model, system + lines + question)[len(system) + len(lines):])
    batch, _ = runner.build_batch(works)
    assert sorted(members for _, members in batch.groups) == [[0, 1, 2], [3, 4, 5]]
    assert all(len(runs) > 1 for runs, _ in batch.groups)  # the shared block and the session's own
    for out, ref in zip(runner.execute(works), refs, strict=True):
        assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("gather_keys", [0, 40, 1024])
def test_gathered_attention_equals_reference(gather_keys):
    """Short sequences attend gathered into padded buckets (one fused call each), the rest run by run:
    every split gives transformers' logits. A mixed batch: branches over several runs, one-token
    decodes and multi-token chunks, lengths in different buckets, a sequence over the gather limit."""
    from streamllm.model.attention import gathered_members

    model = build("llama")
    runner = make_runner(model, num_blocks=128)
    runner.model.gather_keys = gather_keys
    gen = torch.Generator().manual_seed(8)
    bases = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (21, 9, 60, 33)]
    news = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 6, 1, 13)]
    works, refs = [], []
    for base, new in zip(bases, news, strict=True):
        table, _ = prefill(runner, base)
        branch = runner.store.fork(table)  # the new tokens in blocks of their own: several runs
        runner.store.manager.append(branch, len(new))
        works.append(Work(branch, new, len(base), "all"))
        refs.append(hf_logits(model, base + new)[len(base):])
    batch, _ = runner.build_batch(works)
    members = gathered_members(batch.seqs, batch.groups, gather_keys)
    expected = {0: [], 40: [0, 1], 1024: [0, 1, 2, 3]}[gather_keys]  # keys: 22, 15, 61, 46
    assert members == expected
    for out, ref in zip(runner.execute(works), refs, strict=True):
        assert (out - ref).abs().max().item() <= TOL


def test_gathered_buckets_pad_keys_and_queries():
    """Members needing 3/4 of a bucket's keys or more share it (110 and 96 keys: 128; 20 alone: its own 20); padding queries and keys never reach
    a real row (every real row's keys are its own positions, in order)."""
    from streamllm.model.attention import SeqAttention, plan_gathered

    seqs = [SeqAttention(0, 1, 109, [(0, 0, 110)]), SeqAttention(1, 4, 92, [(0, 200, 64), (64, 400, 32)]),
            SeqAttention(5, 1, 19, [(0, 600, 20)])]
    buckets = plan_gathered(seqs, [0, 1, 2], groups=2, dtype=torch.float32, device="cpu")
    assert [(b.members, b.keys, b.queries) for b in buckets] == [([0, 1], 128, 4), ([2], 20, 1)]
    assert buckets[1].mask is None  # alone, a decode reads its own keys exactly: nothing to mask
    first = buckets[0]
    assert first.key_slots[128:128 + 96].tolist() == list(range(200, 264)) + list(range(400, 432))
    assert first.key_slots[128 + 96:256].tolist() == [200] * 32  # padding: the member's first slot, masked
    assert first.out_rows.tolist() == [0, 1, 2, 3, 4] and first.out_sel.tolist() == [0, 4, 5, 6, 7]
    keep = first.mask == 0  # [B, 1, g * queries, keys], rows ordered (group, token)
    assert keep[0, 0, 0].nonzero().flatten().tolist() == list(range(110))  # a decode sees its 110 keys
    assert keep[1, 0, 4 + 1].nonzero().flatten().tolist() == list(range(94))  # group 1, token 1: up to 93
    with pytest.raises(ValueError, match="do not cover positions"):  # a gap: position 10 is nowhere
        plan_gathered([SeqAttention(0, 1, 14, [(0, 0, 10), (11, 40, 4)])], [0], groups=2, dtype=torch.float32,
                      device="cpu")


def test_gathered_buckets_copy_at_most_their_budget_of_keys(monkeypatch):
    """Many long sequences in one step go to several buckets, none copying more than GATHER_BUCKET_KEYS."""
    from streamllm.model import attention
    from streamllm.model.attention import SeqAttention, plan_gathered

    monkeypatch.setattr(attention, "GATHER_BUCKET_KEYS", 1000)
    seqs = [SeqAttention(i, 1, 299, [(0, 300 * i, 300)]) for i in range(7)]  # 300 keys each: 320 a member
    buckets = plan_gathered(seqs, list(range(7)), groups=2, dtype=torch.float32, device="cpu")
    assert [b.members for b in buckets] == [[0, 1, 2], [3, 4, 5], [6]]
    assert all(len(b.members) * b.keys <= 1000 for b in buckets)
