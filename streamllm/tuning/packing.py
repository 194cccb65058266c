"""Many decision points in one sequence, for `streamllm tune --method lora`.

A window's session (system prompt + one line per bar, the engine's PromptLayout) is laid
out once; every labelled question branched off every `stride`-th bar follows it as a
block whose positions continue from that bar's line end. An explicit mask lets each
block see the session up to its bar and itself (causally), nothing else: what the
engine's entry for that question at that bar sees, so a block's last row is exactly the
entry's decision point, while the session's rows are computed once for all blocks.

    rows     [ session 0..S) | block 1 (bar i) | block 2 (bar j) | ... ]
    block 1  sees session [0, end(i)) + itself;  positions end(i), end(i)+1, ...

`sub` takes a few blocks (a training step), keeping only the session rows they need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from streamllm.config import QuestionSpec
from streamllm.engine.prompt import PromptLayout
from streamllm.tuning.extract import render_window, session_ids


@dataclass(slots=True)
class Block:
    """One decision point: question `qid` asked after bar `bar`; `choice` is the label's answer."""

    qid: str
    bar: int
    choice: int
    start: int  # first row in the packed sequence
    length: int
    sees: int  # session rows visible (the bar's line end)


@dataclass(slots=True)
class Packed:
    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    session_rows: int
    blocks: list[Block]
    extra: dict[str, Any] = field(default_factory=dict)  # per-window caches (lower states, base log-probs)

    @property
    def last_rows(self) -> torch.Tensor:
        return torch.tensor([b.start + b.length - 1 for b in self.blocks], dtype=torch.long)

    def mask(self) -> torch.Tensor:
        """Boolean keep-mask [T, T] (True: row may attend to column)."""
        t = self.ids.shape[0]
        seg = torch.zeros(t, dtype=torch.long)  # 0: session, k+1: block k
        limit = torch.arange(t)  # session row r sees columns <= r
        for k, b in enumerate(self.blocks):
            seg[b.start: b.start + b.length] = k + 1
            limit[b.start: b.start + b.length] = b.sees - 1
        col = torch.arange(t)
        in_session = (seg[None, :] == 0) & (col[None, :] <= limit[:, None])
        own = (seg[None, :] == seg[:, None]) & (seg[:, None] > 0) & (col[None, :] <= col[:, None])
        return in_session | own

    def sub(self, blocks: Sequence[Block], extra_rows: int = 0) -> tuple[Packed, torch.Tensor]:
        """A packed sequence of these blocks only; returns it and the rows it took from self."""
        keep = max([b.sees for b in blocks] + [extra_rows])
        rows = [torch.arange(keep)]
        out_blocks, at = [], keep
        for b in blocks:
            rows.append(torch.arange(b.start, b.start + b.length))
            out_blocks.append(Block(b.qid, b.bar, b.choice, at, b.length, b.sees))
            at += b.length
        index = torch.cat(rows)
        return Packed(self.ids[index], self.positions[index], keep, out_blocks), index


def pack_window(layout: PromptLayout, system_prompt: str, bars: Sequence[Any], questions: Sequence[QuestionSpec],
                stride: int, changes: str = "price") -> Packed:
    """The window's session followed by one block per (labelled question, every stride-th bar)."""
    lines = render_window(bars, changes)
    ids, ends = session_ids(layout, layout.prefix_ids(system_prompt), lines)
    history = min(q.label.bars_needed for q in questions)
    positions = list(range(len(ids)))
    out_ids, blocks = list(ids), []
    q_ids = {q.id: layout.question_ids(q.text) for q in questions}
    for i in range(history - 1, len(bars), stride):
        for q in questions:
            truth = q.expected_answer(bars[: i + 1])  # the teacher: labels are read here only
            if truth is None:
                continue
            qi = q_ids[q.id]
            blocks.append(Block(q.id, i, q.choices.index(truth), len(out_ids), len(qi), ends[i]))
            out_ids.extend(qi)
            positions.extend(range(ends[i], ends[i] + len(qi)))
    return Packed(torch.tensor(out_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), len(ids), blocks)
