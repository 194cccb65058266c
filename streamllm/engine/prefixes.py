"""Shared frozen prefixes: sessions of one tenant whose system prompts are identical share those cells.

Once a session's frozen prefix is computed, its full blocks are remembered (one
reference held here) by its tenant and token ids; a later session of the same tenant
with the same prefix starts on them instead of prefilling it again. A prefix nobody
holds any more is forgotten.

Sharing stops at the tenant: a session starting on cached cells shows it (`num_computed`
at open, how fast its prefix is in), so sharing across tenants would tell one tenant
which system prompts another uses.
"""

from __future__ import annotations

from streamllm.engine.kv import BlockTable, KVStore


class SharedPrefixes:
    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.blocks: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # (tenant, full blocks' ids) -> blocks
        self.hits = 0

    def _key(self, tenant: str, prefix: list[int]) -> tuple[str, tuple[int, ...]] | None:
        full = len(prefix) // self.store.block_size * self.store.block_size
        return (tenant, tuple(prefix[:full])) if full else None

    def start(self, table: BlockTable, prefix: list[int], tenant: str) -> int:
        """Put a computed copy of `prefix`'s full blocks, as `tenant` cached them, at the start of an
        empty table; returns tokens covered."""
        key = self._key(tenant, prefix)
        shared = self.blocks.get(key) if key else None
        if not shared:
            return 0
        self.store.manager.share(shared)
        table.blocks, table.num_tokens = list(shared), len(shared) * self.store.block_size
        self.hits += 1
        return table.num_tokens

    def remember(self, token_ids: list[int], prefix_len: int, table: BlockTable, tenant: str) -> None:
        key = self._key(tenant, token_ids[:prefix_len])
        if key is None or key in self.blocks:
            return
        blocks = table.blocks[: len(key[1]) // self.store.block_size]
        self.store.manager.share(blocks)
        self.blocks[key] = blocks

    def forget_unused(self) -> None:
        for key, blocks in list(self.blocks.items()):
            if all(self.store.manager.refcount[b] == 1 for b in blocks):
                self.store.manager.release(blocks)
                del self.blocks[key]

    def tables(self) -> list[BlockTable]:
        """The references held here, as tables (for check_integrity)."""
        return [BlockTable(blocks=list(b), num_tokens=len(b) * self.store.block_size) for b in self.blocks.values()]
