"""Decision-point states for `streamllm tune`: the hidden state a choice head reads.

For one window of bars it builds exactly what the engine would hold for a session
opened at the window's first bar (the config's system prompt, one rendered line per
bar, the engine's PromptLayout), computes that session's KV once on the project's own
model, runner and KV store, then branches every labelled question off every
`stride`-th bar: each branch forks the session's cells at that bar's line end and
prefills only the question, so many decision points share one pass over the data.

    session  [prefix | bar 0 | bar 1 | ... | bar W-1]              computed once
    branch   [prefix | bar 0 .. bar i | Question: ...<assistant>]  -> final normed hidden @ last row

With a tap layer it also keeps every line's features (engine/taps.py, what a series head
reads) and every bar's labels: a series head trains on every bar, not only decision points.

Labels are computed here from the bars (the teacher); nothing in the engine calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streamllm.config import QuestionSpec, SessionSpec
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.prompt import PromptLayout
from streamllm.engine.runner import Runner, Work
from streamllm.engine.taps import LineTaps, Word, word_tables
from streamllm.feeding.render import Renderer
from streamllm.model.llama import LlamaForward

CHUNK_TOKENS = 512  # session prefill per forward
BRANCH_TOKENS = 1536  # question tokens per forward (many branches side by side)


@dataclass(slots=True)
class WindowStates:
    """Per question: hidden states [n, H] at its decision points, the true choice index [n], and the bar index [n];
    with a tap layer, every bar's line features [W, (2 + words) H] and per question every bar's choice index [W] (-1: unknown)."""

    features: dict[str, torch.Tensor]
    labels: dict[str, torch.Tensor]
    bars: dict[str, torch.Tensor]
    tokens: int  # tokens computed for this window (session + branches)
    lines: torch.Tensor | None = None
    line_labels: dict[str, torch.Tensor] | None = None
    seconds: float | None = None  # wall time the extraction took (None: a checkpoint from before it was kept)

    def to_dict(self) -> dict[str, Any]:
        return {"features": self.features, "labels": self.labels, "bars": self.bars, "tokens": self.tokens,
                "lines": self.lines, "line_labels": self.line_labels, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WindowStates:
        return cls(d["features"], d["labels"], d["bars"], int(d["tokens"]), d.get("lines"), d.get("line_labels"),
                   d.get("seconds"))


def session_ids(layout: PromptLayout, prefix: list[int], lines: Sequence[str]) -> tuple[list[int], list[int]]:
    """(token ids of prefix + lines, token index after each line): the session as the engine holds it."""
    ids = list(prefix)
    ends = []
    for line_ids in layout.lines_ids(list(lines)):
        ids.extend(line_ids)
        ends.append(len(ids))
    return ids, ends


def window_labels(questions: Sequence[QuestionSpec], bars: Sequence[Any]) -> dict[str, list[int]]:
    """The teacher: every bar's choice index per question (-1: unknown), from the bars alone, each bar's
    as QuestionSpec.expected_answer gives it at that bar (LabelSpec.truths, one pass over the window; a
    forecast's truth is not in at its own bar, so it is never a label here). Labels are only read here;
    decision points take theirs, a series head trains on all of them."""
    out = {}
    for q in questions:
        if q.label.horizon:
            out[q.id] = [-1] * len(bars)
        else:
            out[q.id] = [-1 if t is None else int(t) for t in q.label.truths(bars).to_list()] if bars else []
    return out


def render_window(bars: Sequence[Any], changes: str = "price") -> list[str]:
    """Lines as a session opened at bars[0] would receive them (a fresh renderer per session;
    changes: the session's `[sessions.render] changes`)."""
    renderer = Renderer(changes=changes)
    return [renderer.render(b) for b in bars]


class StateExtractor:
    def __init__(self, loaded: Any, spec: SessionSpec, questions: Sequence[QuestionSpec], *,
                 max_window_tokens: int = 8192, device: str = "cpu", tap_layer: int | None = None,
                 dtype: str = "float32", words: Sequence[Word] = ()) -> None:
        self.spec = spec
        self.questions = list(questions)
        self.layout = PromptLayout(loaded.tokenizer)
        self.model = LlamaForward(loaded.config, loaded.state_dict, device=device, dtype=dtype)
        self.question_ids = {q.id: self.layout.question_ids(q.text) for q in self.questions}
        self.prefix = self.layout.prefix_ids(spec.system_prompt)
        block = 16
        cells = max_window_tokens + BRANCH_TOKENS + 2 * block * (BRANCH_TOKENS // 8 + 2)
        num_blocks = -(-cells // block)
        self.store = KVStore(BlockManager(num_blocks, block),
                             KVPool(self.model.num_layers, num_blocks * block, self.model.num_kv_heads,
                                    self.model.head_dim, dtype=self.model.kv_dtype, device=self.model.device))
        self.runner = Runner(self.model, self.store, tap_layer=tap_layer)
        self.tap_layer = tap_layer
        self.words = tuple(words)  # the words whose last token a line's features add (engine/taps.py)
        self.word_starts, self.word_texts = word_tables(loaded.tokenizer, self.words)
        self.max_window_tokens = max_window_tokens

    # -- prompts ---------------------------------------------------------------------
    def session_ids(self, lines: Sequence[str]) -> tuple[list[int], list[int]]:
        """(token ids of prefix + lines, token index after each line)."""
        return session_ids(self.layout, self.prefix, lines)

    def decision_prompt(self, lines: Sequence[str], upto: int, question: QuestionSpec) -> list[int]:
        """The full token sequence of the entry for `question` after line `upto` (inclusive)."""
        ids, ends = self.session_ids(lines[: upto + 1])
        return ids + self.layout.question_ids(question.text)

    # -- extraction ------------------------------------------------------------------
    def extract(self, bars: Sequence[Any], *, stride: int = 2, first: int | None = None) -> WindowStates:
        """States at bars first, first+stride, ... of the window (default first: the longest label history - 1)."""
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        history = max(q.label.bars_needed for q in self.questions)
        first = history - 1 if first is None else first
        labels = window_labels(self.questions, bars)
        points = {q.id: [i for i in range(first, len(bars), stride) if labels[q.id][i] >= 0] for q in self.questions}
        lines, hidden, computed = self.extract_parts(bars, points)
        out = WindowStates({}, {}, {}, computed)
        for q in self.questions:
            out.features[q.id] = hidden[q.id]
            out.labels[q.id] = torch.tensor([labels[q.id][i] for i in points[q.id]], dtype=torch.long)
            out.bars[q.id] = torch.tensor(points[q.id], dtype=torch.long)
        if lines is not None:
            out.lines = lines
            out.line_labels = {qid: torch.tensor(y) for qid, y in labels.items()}
        return out

    def extract_parts(self, bars: Sequence[Any], points: dict[str, list[int]]
                      ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], int]:
        """One pass over the window's session: every line's features (with a tap layer, else None) and,
        per question id of `points`, the decision-point hidden states [n, H] after the given bars; with
        the tokens computed (session + branches). Branches run bar by bar, each bar's questions side by side.
        Without decision points the session runs only up to the tap layer (lines are all it is read for)."""
        lines = render_window(bars, self.spec.render.changes)
        ids, ends = self.session_ids(lines)
        if len(ids) > self.max_window_tokens:
            raise ValueError(f"window of {len(bars)} bars is {len(ids)} tokens, over {self.max_window_tokens}")
        manager = self.store.manager
        session = BlockTable()
        computed = 0
        taps = LineTaps(len(lines), self.words, self.word_starts, self.word_texts) if self.tap_layer is not None else None
        order = {qid: k for k, qid in enumerate(self.question_ids)}
        pending = sorted(((bar, qid) for qid, at in points.items() for bar in at), key=lambda p: (p[0], order[p[1]]))
        # Lines alone (no branch reads the session's upper layers): the forward stops at the tap layer.
        # Its features are the full forward's exactly, so the cache key does not say which ran.
        tap_only = taps is not None and not pending
        try:
            manager.append(session, len(ids))
            for start in range(0, len(ids), CHUNK_TOKENS):
                chunk = ids[start: start + CHUNK_TOKENS]
                work = Work(session, chunk, start, "none", want_tap=taps is not None)
                self.runner.execute([work], tap_only=tap_only)
                if taps is not None:  # the engine's own rule for a session's line features
                    taps.add(work.tap, start, chunk, ends, 0, len(self.prefix))
                computed += len(chunk)
            hidden = self._branch_states(session, ends, [(qid, bar) for bar, qid in pending])
            computed += sum(len(self.question_ids[qid]) for _, qid in pending)
        finally:
            manager.free(session)
        rows: dict[str, list[torch.Tensor]] = {qid: [] for qid in points}
        for (_, qid), h in zip(pending, hidden, strict=True):
            rows[qid].append(h)
        width = self.model.config.hidden_size
        states = {qid: torch.stack(r) if r else torch.empty(0, width) for qid, r in rows.items()}
        return (taps.window(len(lines), len(lines)) if taps is not None else None), states, computed

    def _branch_states(self, session: BlockTable, ends: list[int], pending: list[tuple[str, int]]) -> list[torch.Tensor]:
        manager = self.store.manager
        states: list[torch.Tensor] = []
        batch: list[tuple[BlockTable, Work]] = []
        used = 0

        def flush() -> None:
            nonlocal batch, used
            if not batch:
                return
            try:
                self.runner.execute([w for _, w in batch])
                states.extend(w.hidden.float().cpu() for _, w in batch)
            finally:
                for table, _ in batch:
                    manager.free(table)
                batch, used = [], 0

        for qid, bar in pending:
            qids = self.question_ids[qid]
            if used + len(qids) > BRANCH_TOKENS:
                flush()
            base = ends[bar]
            table = self.store.fork(session, base)
            manager.append(table, len(qids))
            batch.append((table, Work(table, qids, base, "last", want_hidden=True)))
            used += len(qids)
        flush()
        return states
