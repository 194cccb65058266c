"""Paged KV store bookkeeping, without a model."""

from __future__ import annotations

import pytest
import torch

from streamllm.engine.kv import BlockManager, BlockTable, KVCapacityError, KVPool, KVStore


def store(num_blocks=8, block_size=4):
    return KVStore(BlockManager(num_blocks, block_size), KVPool(1, num_blocks * block_size, 1, 2))


def test_append_assigns_slots_block_by_block():
    m = BlockManager(8, 4)
    t = BlockTable()
    slots = m.append(t, 6)
    assert len(t.blocks) == 2 and t.num_tokens == 6
    assert slots.tolist() == [t.blocks[0] * 4 + i for i in range(4)] + [t.blocks[1] * 4, t.blocks[1] * 4 + 1]
    assert m.append(t, 2).tolist() == [t.blocks[1] * 4 + 2, t.blocks[1] * 4 + 3]
    assert len(t.blocks) == 2
    m.check_integrity([t])


def test_fork_shares_full_blocks_and_copies_partial_tail():
    s = store()
    m = s.manager
    t = BlockTable()
    m.append(t, 10)  # blocks: full, full, partial(2)
    s.pool.k[0, 0, m.slots(t, 0, 10)] = torch.arange(10.0)[:, None]
    child = s.fork(t)
    assert child.blocks[:2] == t.blocks[:2]
    assert child.blocks[2] != t.blocks[2]
    assert [m.refcount[b] for b in t.blocks] == [2, 2, 1]
    # the copied tail carries the same cells
    assert s.pool.k[0, 0, m.slots(child, 8, 10), 0].tolist() == [8.0, 9.0]
    m.check_integrity([t, child])
    # both grow independently; the parent's tail is still private
    m.append(child, 3)
    m.append(t, 1)
    m.check_integrity([t, child])
    m.free(child)
    assert [m.refcount[b] for b in t.blocks] == [1, 1, 1]
    m.free(t)
    assert m.num_free_blocks == 8
    m.check_integrity([])


def test_fork_at_shorter_length_and_at_block_boundary():
    s = store()
    m = s.manager
    t = BlockTable()
    m.append(t, 12)
    at_boundary = s.fork(t, 8)
    assert at_boundary.blocks == t.blocks[:2] and at_boundary.num_tokens == 8
    mid = s.fork(t, 6)
    assert mid.blocks[0] == t.blocks[0] and mid.blocks[1] not in t.blocks and mid.num_tokens == 6
    m.check_integrity([t, at_boundary, mid])
    with pytest.raises(ValueError):
        s.fork(t, 13)


def test_exhausted_pool_is_a_clear_error_and_allocates_nothing():
    m = BlockManager(3, 4)
    t = BlockTable()
    m.append(t, 8)
    assert not m.can_append(t, 5)
    with pytest.raises(KVCapacityError, match="exhausted"):
        m.append(t, 5)
    assert t.num_tokens == 8 and m.num_free_blocks == 1
    m.check_integrity([t])


def test_reserve_is_contiguous_and_consumed_first():
    m = BlockManager(10, 4)
    other = BlockTable()
    m.append(other, 4)  # takes block 0
    t = BlockTable()
    m.reserve(t, 16)
    assert t.reserved == [1, 2, 3, 4]
    assert m.num_free_blocks == 5 and m.num_reserved == 4
    m.append(t, 10)
    assert t.blocks == [1, 2, 3] and t.reserved == [4]
    assert m.runs(t) == [(0, 4, 10)]  # one contiguous run
    assert m.blocks_needed(t, 6) == 0 and m.blocks_needed(t, 7) == 1
    m.check_integrity([other, t])
    m.free(t)
    assert m.num_reserved == 0
    m.check_integrity([other])


def test_runs_split_where_blocks_are_not_adjacent():
    m = BlockManager(8, 4)
    t = BlockTable(blocks=[5, 6, 2], num_tokens=11)
    for b in t.blocks:
        m.refcount[b] = 1
    assert m.runs(t) == [(0, 20, 8), (8, 8, 3)]
    assert m.runs(t, 6) == [(0, 20, 6)]


def test_truncate_copies_a_shared_partial_tail():
    s = store()
    m = s.manager
    t = BlockTable()
    m.append(t, 8)
    child = s.fork(t)  # shares both full blocks
    s.truncate(child, 6)  # its tail block is now partial: must not stay shared
    assert child.blocks[0] == t.blocks[0] and child.blocks[1] != t.blocks[1]
    m.check_integrity([t, child])


def test_integrity_catches_a_leak():
    m = BlockManager(4, 4)
    t = BlockTable()
    m.append(t, 4)
    with pytest.raises(AssertionError):
        m.check_integrity([])


def test_lay_out_reproduces_runs_and_refuses_what_it_cannot():
    m = BlockManager(num_blocks=16, block_size=4)
    table = BlockTable()
    m.reserve(table, 32)  # 8 contiguous blocks
    assert m.lay_out(table, [8, 4, 6])  # runs of 2, 1 and 2 blocks (the last one partial)
    m.append(table, 18)
    assert [(pos, n) for pos, _, n in m.runs(table)] == [(0, 8), (8, 4), (12, 6)]
    m.append(table, 14)  # the last run grows into the rest of the budget, still one run
    assert [(pos, n) for pos, _, n in m.runs(table)] == [(0, 8), (8, 4), (12, 20)]
    m.check_integrity([table])
    fresh = BlockTable()
    m.reserve(fresh, 16)
    before = list(fresh.reserved)
    assert not m.lay_out(fresh, [6, 4])  # a run before the last must be whole blocks
    assert not m.lay_out(fresh, [16, 8])  # more than the budget
    assert fresh.reserved == before
