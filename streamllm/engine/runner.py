"""Executes a plan: one forward over a ragged batch of sequences. Never decides who runs.

Each `Work` names a block table whose slots for the new tokens are already assigned
(the engine appends before it plans), the new token ids, and which logits it wants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamllm.engine.kv import BlockTable, KVStore
from streamllm.engine.sequence import Logits
from streamllm.model.attention import SeqAttention, shared_prefix_groups
from streamllm.model.llama import ForwardBatch, LlamaForward


@dataclass(slots=True)
class Work:
    table: BlockTable
    token_ids: list[int]  # tokens computed in this step
    start_pos: int  # position of token_ids[0]; table holds slots up to start_pos + len
    want_logits: Logits = Logits.LAST
    want_hidden: bool = False  # with LAST: also the final-normed hidden state of that row (choice heads)
    hidden: torch.Tensor | None = None  # [H], filled by execute when want_hidden
    want_tap: bool = False  # the residual of every row at the runner's tap_layer (series heads read lines)
    tap: torch.Tensor | None = None  # [n, H] fp32, filled by execute when want_tap


class Runner:
    def __init__(self, model: LlamaForward, store: KVStore, grouped: bool = True, tap_layer: int | None = None) -> None:
        self.model = model
        self.store = store
        self.grouped = grouped  # read a prefix shared by several sequences once per layer
        self.tap_layer = tap_layer  # the layer whose residual want_tap works receive (series heads)
        self.forward_calls = 0
        self.tokens_computed = 0

    def build_batch(self, works: list[Work]) -> tuple[ForwardBatch, list[slice | None]]:
        manager = self.store.manager
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seqs: list[SeqAttention] = []
        logit_rows: list[int] = []
        logit_slices: list[slice | None] = []
        for w in works:
            n = len(w.token_ids)
            if n == 0:
                raise ValueError("a work item must compute at least one token")
            end = w.start_pos + n
            if w.table.num_tokens < end:
                raise ValueError(f"table holds {w.table.num_tokens} slots, work needs {end}")
            row0 = len(ids)
            ids.extend(w.token_ids)
            positions.append(torch.arange(w.start_pos, end))
            slots.append(manager.slots(w.table, w.start_pos, end))
            seqs.append(SeqAttention(row0, n, w.start_pos, manager.runs(w.table, end)))
            if w.want_logits == Logits.LAST:
                logit_slices.append(slice(len(logit_rows), len(logit_rows) + 1))
                logit_rows.append(row0 + n - 1)
            elif w.want_logits == Logits.ALL:
                logit_slices.append(slice(len(logit_rows), len(logit_rows) + n))
                logit_rows.extend(range(row0, row0 + n))
            else:
                logit_slices.append(None)
        device = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.cat(positions).to(device),
            slot_mapping=torch.cat(slots).to(device),
            seqs=seqs,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
            groups=shared_prefix_groups(seqs) if self.grouped else [],
        )
        return batch, logit_slices

    def execute(self, works: list[Work], *, tap_only: bool = False,
                between_layers: Callable[[], None] | None = None) -> list[torch.Tensor | None]:
        """Logits per work: [vocab] for LAST, [n, vocab] for ALL, None for NONE.

        tap_only: every work wants its tap and nothing else, so the forward stops at the tap layer
        (LlamaForward.forward's stop_at_tap: the layers above leave these rows' cells unwritten).
        between_layers: called between two layers of this forward; it may execute other works, whose
        tables share no cell this batch writes (the engine's questions cut in there)."""
        if not works:
            return []
        want_tap = any(w.want_tap for w in works)
        if want_tap and self.tap_layer is None:
            raise ValueError("a work wants tapped rows but the runner has no tap_layer")
        if tap_only and not all(w.want_tap and not w.want_hidden and w.want_logits == Logits.NONE for w in works):
            raise ValueError("tap_only: every work must want its tap alone (no logits, no hidden state)")
        batch, logit_slices = self.build_batch(works)
        want_hidden = any(w.want_hidden for w in works)
        tap_layer = self.tap_layer if want_tap else None
        result = self.model.forward(batch, self.store.pool.k, self.store.pool.v, return_hidden=want_hidden,
                                  tap_layer=tap_layer, stop_at_tap=tap_only, between_layers=between_layers)
        logits = result if isinstance(result, torch.Tensor) else result.logits
        if want_hidden or tap_layer is not None:
            for w, sl, seq in zip(works, logit_slices, batch.seqs, strict=True):
                if w.want_hidden and sl is not None:
                    w.hidden = result.hidden[sl.stop - 1]
                if w.want_tap:
                    w.tap = result.tap[seq.q_start: seq.q_start + seq.q_len]
        self.forward_calls += 1
        self.tokens_computed += int(batch.input_ids.shape[0])
        out: list[torch.Tensor | None] = []
        for w, sl in zip(works, logit_slices, strict=True):
            if sl is None:
                out.append(None)
            elif w.want_logits == Logits.LAST:
                out.append(logits[sl.start])
            else:
                out.append(logits[sl])
        return out
