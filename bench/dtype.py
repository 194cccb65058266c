"""bf16 against fp32 on one model, side by side: forward speed, and what bf16 changes in the answers.

Used by `streamllm bench query` (both dtypes in one run) and tests/test_bf16.py. Works on
the runner directly (no engine thread), so both dtypes see the same batches:

  prefill     512 tokens of market lines into fresh cells
  decode      one token on a session holding `context` tokens
  update      one bar line ingested, then 4 standing questions re-positioned on top of it
              (4 entries forked from the session, prefilled together: what the engine
              does after each push)
  gate        every shipped question with choices (queries/*.toml), at decision points
              over synthetic bar contexts: the gate's decision in fp32 and in bf16
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from streamllm.config import QuestionSpec, load_config
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.prompt import PromptLayout
from streamllm.engine.runner import Runner, Work
from streamllm.engine.standing.gate import Gate
from streamllm.model.llama import LlamaForward

QUERIES = Path(__file__).resolve().parents[1] / "queries"
# A gate decision counts as flipped only if fp32's gap is this far from the threshold (or from
# a tie between choices): bf16 moves a decision point's choice gap by up to ~0.3 logits on
# SmolLM2-135M (docs/engine.md), so closer calls may go either way in either dtype.
CLEAR_MARGIN = 0.5


@dataclass(slots=True)
class Rig:
    """A model with its own KV pool and runner."""

    runner: Runner
    layout: PromptLayout

    @property
    def model(self) -> LlamaForward:
        return self.runner.model

    @property
    def store(self) -> KVStore:
        return self.runner.store

    def table(self, ids: list[int], chunk: int = 512) -> BlockTable:
        """A fresh table holding `ids`, computed."""
        table = BlockTable()
        self.store.manager.append(table, len(ids))
        for start in range(0, len(ids), chunk):
            self.runner.execute([Work(table, ids[start : start + chunk], start, "none")])
        return table

    def free(self, table: BlockTable) -> None:
        self.store.manager.free(table)


def make_rig(loaded, dtype: str, cells: int = 8192, device: str = "cpu", fp32_rows: int | None = None,
             block_size: int = 16) -> Rig:
    model = LlamaForward(loaded.config, loaded.state_dict, device=device, dtype=dtype, fp32_rows=fp32_rows)
    blocks = cells // block_size
    pool = KVPool(model.num_layers, blocks * block_size, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype,
                  device=device)
    return Rig(Runner(model, KVStore(BlockManager(blocks, block_size), pool)), PromptLayout(loaded.tokenizer))


def session_ids(layout: PromptLayout, system: str, lines: list[str]) -> list[int]:
    return layout.prefix_ids(system) + [t for ids in layout.lines_ids(lines) for t in ids]


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


# -- speed ----------------------------------------------------------------------
def prefill_ms(rig: Rig, ids: list[int]) -> float:
    table = BlockTable()
    rig.store.manager.append(table, len(ids))
    try:
        return ms(lambda: rig.runner.execute([Work(table, ids, 0, "last")]))
    finally:
        rig.free(table)


def decode_ms(rig: Rig, table: BlockTable, token: int) -> float:
    """One token at the end of `table` (its cell is overwritten on every call)."""
    fork = rig.store.fork(table)
    rig.store.manager.append(fork, 1)
    try:
        return ms(lambda: rig.runner.execute([Work(fork, [token], table.num_tokens, "last")]))
    finally:
        rig.free(fork)


def update_ms(rig: Rig, table: BlockTable, line: str, questions: list[list[int]]) -> float:
    """Ingest one bar line into `table`, then re-position every question on top of it (one batch)."""
    (line_ids,) = rig.layout.lines_ids([line])
    manager, runner = rig.store.manager, rig.runner
    entries: list[BlockTable] = []

    def step() -> None:
        start = table.num_tokens
        manager.append(table, len(line_ids))
        runner.execute([Work(table, line_ids, start, "none")])
        works = []
        for q in questions:
            entry = rig.store.fork(table)
            manager.append(entry, len(q))
            entries.append(entry)
            works.append(Work(entry, q, table.num_tokens, "last"))
        runner.execute(works)

    try:
        return ms(step)
    finally:
        for entry in entries:
            rig.free(entry)


# -- parity ---------------------------------------------------------------------
@dataclass(slots=True)
class GateCase:
    system: str
    spec: QuestionSpec


@dataclass(slots=True)
class Parity:
    max_abs_logit_diff: float = 0.0  # over the full vocabulary at every decision point
    max_gap_diff: float = 0.0  # |gap_fp32 - gap_bf16| of the gate
    decisions: int = 0
    changed: int = 0  # decisions (fired, answer) that differ at all
    flips: int = 0  # ... of which fp32's call was clear (CLEAR_MARGIN from threshold and from a tie)
    top1_changed: int = 0  # vocabulary top-1 differs where fp32's top-1 leads by CLEAR_MARGIN
    details: list[dict] = field(default_factory=list)


def shipped_gate_cases() -> list[GateCase]:
    """Every question with choices in queries/*.toml, once per (system prompt, text)."""
    seen: set[tuple[str, str]] = set()
    cases = []
    for path in sorted(QUERIES.glob("*.toml")):
        for session in load_config(path).sessions:
            for spec in session.questions:
                key = (session.system_prompt, spec.text)
                if spec.choices and key not in seen:
                    seen.add(key)
                    cases.append(GateCase(session.system_prompt, spec))
    return cases


def decision_logits(rig: Rig, cases: list[GateCase], lines: list[str],
                    checkpoints: list[int]) -> list[tuple[GateCase, torch.Tensor]]:
    """Ready distributions: per system prompt, per checkpoint (lines so far), per question."""
    out = []
    for system in dict.fromkeys(c.system for c in cases):
        mine = [c for c in cases if c.system == system]
        questions = [rig.layout.question_ids(c.spec.text) for c in mine]
        table = rig.table(session_ids(rig.layout, system, lines[: checkpoints[0]]))
        try:
            done = checkpoints[0]
            for n in checkpoints:
                new = [t for ids in rig.layout.lines_ids(lines[done:n]) for t in ids]
                if new:
                    start = table.num_tokens
                    rig.store.manager.append(table, len(new))
                    rig.runner.execute([Work(table, new, start, "none")])
                done = n
                entries = []
                for q in questions:
                    entry = rig.store.fork(table)
                    rig.store.manager.append(entry, len(q))
                    entries.append(entry)
                logits = rig.runner.execute([Work(e, q, table.num_tokens, "last")
                                             for e, q in zip(entries, questions, strict=True)])
                out += [(c, lg.float().cpu()) for c, lg in zip(mine, logits, strict=True)]
                for entry in entries:
                    rig.free(entry)
        finally:
            rig.free(table)
    return out


def gate_parity(ref: Rig, other: Rig, tokenizer, line_sets: list[list[str]], checkpoints: list[int],
                cases: list[GateCase] | None = None) -> Parity:
    """Compare the gate's decisions of `other` against `ref` at every (context, checkpoint, question)."""
    cases = cases or shipped_gate_cases()
    gates = {id(c): Gate.for_question(c.spec, tokenizer) for c in cases}
    parity = Parity()
    for lines in line_sets:
        a = decision_logits(ref, cases, lines, checkpoints)
        b = decision_logits(other, cases, lines, checkpoints)
        for (case, la), (_, lb) in zip(a, b, strict=True):
            parity.max_abs_logit_diff = max(parity.max_abs_logit_diff, (la - lb).abs().max().item())
            gate = gates[id(case)]
            da, db = gate.decide(la), gate.decide(lb)
            parity.decisions += 1
            parity.max_gap_diff = max(parity.max_gap_diff, abs(da.gap - db.gap))
            clear = abs(da.gap - gate.threshold) >= CLEAR_MARGIN and da.gap >= CLEAR_MARGIN
            changed = (da.fired, da.answer) != (db.fired, db.answer)
            parity.changed += changed
            parity.flips += changed and clear
            top2 = la.topk(2)
            if la.argmax() != lb.argmax() and (top2.values[0] - top2.values[1]).item() >= CLEAR_MARGIN:
                parity.top1_changed += 1
            parity.details.append({"question": case.spec.id, "gap_ref": da.gap, "gap": db.gap, "fired_ref": da.fired,
                                   "fired": db.fired, "answer_ref": da.answer, "answer": db.answer})
    return parity


def synthetic_lines(seed: int, n: int) -> list[str]:
    from bench.common import market_lines

    lines: Iterator[str] = market_lines(seed=seed)
    return [next(lines) for _ in range(n)]
