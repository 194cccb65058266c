"""Paged KV store: one pool of fixed-size blocks, block tables, refcounts, forks.

Bookkeeping (`BlockManager`) is separate from the tensors (`KVPool`), as in
nano-vllm's block manager: the scheduler can ask `can_append` without touching a
tensor, and tests run without a model.

A session reserves its *working set* when it opens (admission, engine/admission.py):
one contiguous run of the pool whenever first-fit finds one, so attention reads it as a
view. Past it a session's table *grows*: when it needs a block it takes a run of
max(`grow_blocks`, half the blocks it holds) at once (right after its last block when
those are free, up to its max_context), the rest held as its reservation. Attention reads
a session run by run and a decode step pays per run (model/attention.py), so runs grow
with the session: a session of n blocks is O(log n) runs, never one per block. Growth
never takes the last `keep_free` blocks: those stay for branches (questions, entries)
and compaction copies, which take blocks from the whole free pool. Reserved blocks not
filled yet go back when the pool is short (`trim`).

    session table:  [b7 b8 b9 b10 | b11 b12 (reserved, empty)]
    branch fork:    [b7 b8 b9 | b40 (copy of b10's filled slots) | b41 ...]

Invariants: a block shared by more than one table is always full, so nobody ever writes
into a shared block (the partial tail is copied at fork time); the manager never hands
out a block it does not have (`KVCapacityError`, nothing allocated).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


class KVCapacityError(RuntimeError):
    """The pool cannot hold what was asked; nothing was allocated."""


@dataclass(slots=True)
class BlockTable:
    """The blocks of one sequence, in order, and how many token slots are assigned."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Blocks set aside (admission, growth in runs), consumed by append before the free pool.
    reserved: list[int] = field(default_factory=list)
    # A session's table: its max_context; it grows in runs up to it and leaves `keep_free` blocks free.
    # 0: a branch or a copy, which takes exactly the blocks it needs.
    grow_to: int = 0

    @property
    def grows(self) -> bool:
        return self.grow_to > 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, grow_blocks: int = 1) -> None:
        if num_blocks <= 0 or block_size <= 0 or grow_blocks <= 0:
            raise ValueError(f"need num_blocks, block_size and grow_blocks > 0, got {num_blocks}, {block_size}, "
                             f"{grow_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.grow_blocks = grow_blocks  # blocks a growing table takes at once (one run), when they are free
        self.keep_free = 0  # blocks a growing table's growth never takes (branches' and copies' room)
        self.refcount = [0] * num_blocks
        self._is_free = [True] * num_blocks
        self._free: set[int] = set(range(num_blocks))
        self.num_reserved = 0

    # -- capacity ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks that append(table, n) would take from the free pool."""
        have = len(table.blocks) * self.block_size - table.num_tokens
        extra = self.blocks_for(max(0, num_new_tokens - have))
        return max(0, extra - len(table.reserved))

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.blocks_needed(table, num_new_tokens) <= self.available_to(table)

    def available_to(self, table: BlockTable) -> int:
        """Free blocks `table` may take: all of them, but the last `keep_free` for a growing table."""
        return max(0, self.num_free_blocks - self.keep_free) if table.grows else self.num_free_blocks

    def can_reserve(self, num_tokens: int, keep_free_tokens: int = 0) -> bool:
        """Whether reserve(num_tokens) fits and still leaves keep_free_tokens of free cells."""
        return self.blocks_for(num_tokens) + self.blocks_for(keep_free_tokens) <= self.num_free_blocks

    # -- allocation -------------------------------------------------------
    def _take(self, count: int, contiguous: bool, after: int | None = None, avoid: int | None = None) -> list[int]:
        """Take `count` free blocks: right after block `after` if free (the table's run goes
        on), else a contiguous run if asked, else any (one block: one with a free block after
        it, so what follows can go on in one run); never block `avoid` while others are free."""
        if count > len(self._free):
            raise KVCapacityError(
                f"KV pool exhausted: need {count} blocks of {self.block_size} cells, "
                f"{len(self._free)} free of {self.num_blocks}; raise max_cells or close sessions"
            )
        hidden = avoid is not None and 0 <= avoid < self.num_blocks and self._is_free[avoid] and len(self._free) > count
        if hidden:
            self._is_free[avoid] = False
            self._free.discard(avoid)
        try:
            ids = None
            if after is not None and after + count < self.num_blocks and all(
                self._is_free[b] for b in range(after + 1, after + 1 + count)
            ):
                ids = list(range(after + 1, after + 1 + count))
            if ids is None and contiguous and count > 1:
                ids = self._first_fit(count)
            if ids is None and count == 1:
                candidates = list(itertools.islice(self._free, 32))
                ids = [next((b for b in candidates if b + 1 < self.num_blocks and self._is_free[b + 1]), candidates[0])]
            if ids is None:
                ids = sorted(self._free)[:count]
        finally:
            if hidden:
                self._is_free[avoid] = True
                self._free.add(avoid)
        for b in ids:
            self._free.discard(b)
            self._is_free[b] = False
            self.refcount[b] = 1
        return ids

    def _first_fit(self, count: int) -> list[int] | None:
        run_start, run_len = 0, 0
        for b in range(self.num_blocks):
            if self._is_free[b]:
                if run_len == 0:
                    run_start = b
                run_len += 1
                if run_len == count:
                    return list(range(run_start, run_start + count))
            else:
                run_len = 0
        return None

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on blocks already in use (a shared prefix, a fork)."""
        for b in blocks:
            if self._is_free[b]:
                raise AssertionError(f"cannot share free block {b}")
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._release(b)

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] < 0:
            raise AssertionError(f"block {block} released more often than taken")
        if self.refcount[block] == 0:
            self._is_free[block] = True
            self._free.add(block)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Set aside blocks so `table` can grow to num_tokens without touching the free pool."""
        need = self.blocks_for(num_tokens) - len(table.blocks) - len(table.reserved)
        if need <= 0:
            return
        table.reserved.extend(self._take(need, contiguous=True))
        self.num_reserved += need

    def lay_out(self, table: BlockTable, run_tokens: list[int]) -> bool:
        """Order an empty table's reserved blocks so that appending sum(run_tokens) tokens lands in
        runs of exactly these lengths (`runs`); False, and the order untouched, when it cannot.

        A restored session must attend over the runs it had live: attention merges per-run
        partials, so where the runs split changes the rounding (bf16 most of all). Needs the
        reservation to be one contiguous range (first-fit gives one whenever the pool has it):

            logical:   run 1 | run 2 | ... | run k | rest of the budget
            physical:  [run k, rest][run k-1] ... [run 1]   no run sits right before its successor
        """
        bs = self.block_size
        counts = [self.blocks_for(n) for n in run_tokens]
        reserved = sorted(table.reserved)
        if (table.blocks or not run_tokens or min(run_tokens) < 1 or sum(counts) > len(reserved)
                or any(n % bs for n in run_tokens[:-1])  # only the last run may end in a partial block
                or reserved[-1] - reserved[0] + 1 != len(reserved)):
            return False
        physical = [reserved[: len(reserved) - sum(counts[:-1])]]  # the last run, then what it grows into
        at = len(physical[0])
        for count in reversed(counts[:-1]):
            physical.append(reserved[at: at + count])
            at += count
        table.reserved = [b for run in reversed(physical) for b in run]
        return True

    def append(self, table: BlockTable, num_new_tokens: int) -> torch.Tensor:
        """Assign slots for num_new_tokens more tokens; returns their flat slot ids."""
        if not self.can_append(table, num_new_tokens):
            kept = f" ({self.keep_free} kept for branches and copies)" if table.grows else ""
            raise KVCapacityError(
                f"KV pool exhausted: appending {num_new_tokens} tokens needs "
                f"{self.blocks_needed(table, num_new_tokens)} blocks, {self.num_free_blocks} free{kept}; "
                "raise max_cells or close sessions"
            )
        start = table.num_tokens
        end = start + num_new_tokens
        while len(table.blocks) * self.block_size < end and table.reserved:
            table.blocks.append(table.reserved.pop(0))
            self.num_reserved -= 1
        missing = self.blocks_for(end) - len(table.blocks)
        if missing > 0:
            last = table.blocks[-1] if table.blocks else None
            avoid = None
            if last is not None and self.refcount[last] > 1:
                # a block shared with another table (a fork's session): this table's own blocks start a
                # run of their own, so its runs split at the fork point whatever the pool's layout
                # (a restored session's branches then read the same runs as the live one's did)
                last, avoid = None, last + 1
            take = missing
            if table.grows:  # a run that grows with the table, within its max_context and what it may take
                run = max(self.grow_blocks, len(table.blocks) // 2)
                take = max(missing, min(run, self.blocks_for(table.grow_to) - len(table.blocks),
                                        self.available_to(table)))
            ids = self._take(take, contiguous=True, after=last, avoid=avoid)
            table.blocks.extend(ids[:missing])
            table.reserved.extend(ids[missing:])  # the rest of the run: this table's next blocks
            self.num_reserved += take - missing
        table.num_tokens = end
        return self.slots(table, start, end)

    def fork(self, table: BlockTable, length: int | None = None) -> tuple[BlockTable, tuple[int, int, int] | None]:
        """A new table seeing the first `length` tokens of `table`.

        Full blocks are shared (refcount +1). A partial tail is copied: the returned
        (src_block, dst_block, num_slots) tells the pool what to copy.
        """
        length = table.num_tokens if length is None else length
        if not 0 <= length <= table.num_tokens:
            raise ValueError(f"fork length {length} outside 0..{table.num_tokens}")
        full, tail = divmod(length, self.block_size)
        if tail and not self.num_free_blocks:
            raise KVCapacityError("KV pool exhausted: no free block to copy a fork's partial tail")
        shared = table.blocks[:full]
        self.share(shared)
        child = BlockTable(blocks=list(shared), num_tokens=full * self.block_size)
        copy = None
        if tail:
            (dst,) = self._take(1, contiguous=False)
            child.blocks.append(dst)
            child.num_tokens = length
            copy = (table.blocks[full], dst, tail)
        return child, copy

    def truncate(self, table: BlockTable, length: int) -> tuple[int, int, int] | None:
        """Drop the tokens of `table` past `length`. A partial tail block that is shared moves to a
        block of its own: the returned (src_block, dst_block, num_slots) tells the pool what to copy."""
        if not 0 <= length <= table.num_tokens:
            raise ValueError(f"truncate length {length} outside 0..{table.num_tokens}")
        keep = self.blocks_for(length)
        for b in table.blocks[keep:]:
            self._release(b)
        del table.blocks[keep:]
        table.num_tokens = length
        tail = length % self.block_size
        if not tail or self.refcount[table.blocks[-1]] <= 1:
            return None
        src = table.blocks[-1]
        (dst,) = self._take(1, contiguous=False)
        self._release(src)  # still held by the tables that share it: its cells stay as they are
        table.blocks[-1] = dst
        return src, dst, tail

    def trim(self, table: BlockTable, keep_tokens: int) -> int:
        """Give back the reserved blocks `table` does not need to hold keep_tokens (its guarantee);
        returns how many went back to the free pool."""
        keep = max(0, self.blocks_for(keep_tokens) - len(table.blocks))
        extra = table.reserved[keep:]
        del table.reserved[keep:]
        self.num_reserved -= len(extra)
        self.release(extra)
        return len(extra)

    def free(self, table: BlockTable) -> None:
        for b in table.blocks:
            self._release(b)
        for b in table.reserved:
            self._release(b)
        self.num_reserved -= len(table.reserved)
        table.blocks.clear()
        table.reserved.clear()
        table.num_tokens = 0
        table.grow_to = 0

    # -- addressing -------------------------------------------------------
    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table.blocks, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def runs(self, table: BlockTable, length: int | None = None) -> list[tuple[int, int, int]]:
        """The first `length` tokens as runs of consecutive slots: (first_pos, first_slot, n)."""
        length = table.num_tokens if length is None else length
        out: list[tuple[int, int, int]] = []
        bs = self.block_size
        for i in range(self.blocks_for(length)):
            n = min(bs, length - i * bs)
            slot = table.blocks[i] * bs
            if out and out[-1][1] + out[-1][2] == slot and out[-1][2] % bs == 0:
                pos0, slot0, n0 = out[-1]
                out[-1] = (pos0, slot0, n0 + n)
            else:
                out.append((i * bs, slot, n))
        return out

    # -- checking ---------------------------------------------------------
    def check_integrity(self, tables: list[BlockTable]) -> None:
        """Refcounts equal the references held by `tables` (all live tables), free list agrees."""
        counts = [0] * self.num_blocks
        reserved = 0
        for t in tables:
            if t.num_tokens > len(t.blocks) * self.block_size:
                raise AssertionError(f"table holds {t.num_tokens} tokens in {len(t.blocks)} blocks")
            for b in t.blocks + t.reserved:
                counts[b] += 1
            reserved += len(t.reserved)
        for b in range(self.num_blocks):
            if counts[b] != self.refcount[b]:
                raise AssertionError(f"block {b}: refcount {self.refcount[b]}, referenced {counts[b]} times")
            if (counts[b] == 0) != (b in self._free) or self._is_free[b] != (b in self._free):
                raise AssertionError(f"block {b}: free-list disagrees with refcount {counts[b]}")
        if reserved != self.num_reserved:
            raise AssertionError(f"{self.num_reserved} blocks counted reserved, tables hold {reserved}")
        for t in tables:
            tail_full = t.num_tokens % self.block_size == 0
            if t.blocks and not tail_full and self.refcount[t.blocks[t.num_tokens // self.block_size]] != 1:
                raise AssertionError("a partially filled block is shared: writes would leak across tables")


class KVPool:
    """The tensors: per layer, keys and values as [num_kv_heads, num_slots, head_dim].

    Heads first so that a run of slots is directly a [H, n, D] view for attention.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, num_slots, head_dim)
        # torch.empty: pages are only touched as cells fill, so a large budget costs nothing up front.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k.element_size()

    def copy_slots(self, src_slot: int, dst_slot: int, n: int) -> None:
        self.k[:, :, dst_slot : dst_slot + n] = self.k[:, :, src_slot : src_slot + n]
        self.v[:, :, dst_slot : dst_slot + n] = self.v[:, :, src_slot : src_slot + n]


class KVStore:
    """Block manager + pool: the one object the engine and runner share."""

    def __init__(self, manager: BlockManager, pool: KVPool) -> None:
        self.manager = manager
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    def fork(self, table: BlockTable, length: int | None = None) -> BlockTable:
        child, copy = self.manager.fork(table, length)
        self._copy_tail(copy)
        return child

    def truncate(self, table: BlockTable, length: int) -> None:
        """Drop tokens past `length` (their blocks return to the pool unless shared).

        If the new tail block is partial and shared, it is copied first so that later
        appends never write into another table's cells.
        """
        self._copy_tail(self.manager.truncate(table, length))

    def _copy_tail(self, copy: tuple[int, int, int] | None) -> None:
        """Copy a partial tail block's slots the manager moved to a block of its own (src, dst, slots)."""
        if copy is not None:
            src, dst, n = copy
            bs = self.manager.block_size
            self.pool.copy_slots(src * bs, dst * bs, n)
