"""A session's whole state as plain data, taken from and put back into the core.

These run on the core thread (the `ExportSession`, `EvictState`, `ImportSession` commands): the core is the only
writer, so exporting copies cells while nothing can move the table, and importing
allocates and fills cells between two steps. Files, hashing and fsync are the
caller's business (`streamllm.durability.snapshot`), off the core thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from streamllm.config import QuestionSpec
from streamllm.engine.kv import BlockTable, KVCapacityError
from streamllm.engine.outputs import SessionError, SessionInfo
from streamllm.engine.sequence import Session
from streamllm.engine.standing.gate import Gate
from streamllm.model.adapter import series_width

if TYPE_CHECKING:
    from streamllm.engine.core import EngineCore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SessionState:
    meta: dict[str, Any]  # counters and bookkeeping (JSON-able)
    k: torch.Tensor  # [layers, kv_heads, num_computed, head_dim] on CPU
    v: torch.Tensor
    token_ids: list[int]
    questions: list[QuestionSpec] = field(default_factory=list)
    # Series heads' line features (engine/taps.py): [n, (2 + W) H] and each line's number; None without them.
    line_features: torch.Tensor | None = None
    line_index: torch.Tensor | None = None
    # Live learning (engine/standing/learning.py): "learned/<question id>/<name>" -> tensor; meta["learned"] the rest.
    learned: dict[str, torch.Tensor] = field(default_factory=dict)


def busy_reasons(core: EngineCore, name: str) -> list[str]:
    """Why session `name` cannot be evicted now: work someone waits on. Background work nobody waits on
    (an entry computing with no ask waiting for it, a standing-answer decode with no subscriber to hear it)
    does not count: the eviction drops it (`droppable_work`) and a restore starts it again."""
    s: Session = core.session(name)
    standing = core.prepos.standing(name)
    heard = core.hub.has(name, "standing")
    return [why for why, cond in (
        ("pending ingest", s.pending_tokens > 0),
        ("questions in flight", core.answerer.asks_on(s)),
        ("compaction running", name in core.compactor.copies),
        ("questions waiting for entries", any(st.waiters for st in standing)),
        ("standing answers decoding for subscribers", heard and any(st.decoding is not None for st in standing)),
    ) if cond]


def droppable_work(core: EngineCore, name: str) -> int:
    """Entries computing and standing decodes of `name` that an eviction would drop (nobody waits on them)."""
    return sum((st.computing is not None) + (st.decoding is not None) for st in core.prepos.standing(name))


def _gather(cache: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """A session's cells [layers, kv_heads, n, head_dim] on the CPU, read run by run (slices, not an
    index gather: its cells sit in a few runs of consecutive slots)."""
    parts = [cache.narrow(2, slot, n) for _, slot, n in runs]
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].clone()
    return out.cpu()


def export_session(core: EngineCore, name: str) -> SessionState:
    """Copy session `name`'s computed cells and bookkeeping (pending tokens travel as ids)."""
    s: Session = core.session(name)
    manager, pool = core.store.manager, core.store.pool
    n = s.num_computed
    runs = manager.runs(s.table, n)
    meta = {
        "session": s.name, "tenant": s.tenant, "system": s.system, "max_context": s.max_context, "prefix_len": s.prefix_len,
        "num_tokens": s.num_tokens, "num_computed": n, "version_base": s.version_base,
        "version_ends": list(s.version_ends), "version_lines": list(s.version_lines),
        "line_ends": list(s.line_ends), "lines_cut": s.lines_cut, "data_version": s.data_version, "lines_ingested": s.lines_ingested,
        "compactions": s.compactions, "tokens_dropped": s.tokens_dropped,
        # where the cells' runs of consecutive slots split: attention rounds per run (model/attention.py),
        # so the import lays the cells out the same way and the session answers exactly as it did
        "runs": [count for _, _, count in runs],
    }
    # Each labelled question's live calibration window travels too: an auto gate stays open across an
    # eviction, a move or a restart from a checkpoint instead of closing until there is new evidence.
    meta["calibration"] = {st.spec.id: st.calibration.export() for st in core.prepos.standing(name)
                           if st.calibration.samples}
    state = SessionState(meta, _gather(pool.k, runs), _gather(pool.v, runs),
                         list(s.token_ids), [st.spec for st in core.prepos.standing(name)])
    # What each learning question has learned travels too: its head, samples and the lines they read.
    meta["learned"] = {}
    for st in core.prepos.standing(name):
        if st.learner is not None:
            learned, tensors = st.learner.export(st.gate.head)
            meta["learned"][st.spec.id] = learned
            state.learned.update({f"learned/{st.spec.id}/{k}": t for k, t in tensors.items()})
    if s.taps is not None and s.taps.lines:
        state.line_index = torch.tensor([i for i, _ in s.taps.lines], dtype=torch.int64)
        state.line_features = torch.stack([f for _, f in s.taps.lines]).to("cpu", torch.float32)
    return state


def export_ready(core: EngineCore, name: str) -> SessionState | None:
    """`export_session`, or None when the session is not open or its prefix is not computed yet (checkpoints)."""
    s = core.sessions.get(name)
    if s is None or not s.ready:
        return None
    return export_session(core, name)


def evict_session(core: EngineCore, name: str) -> SessionState:
    """Export an idle session and drop it from the core (its subscribers stay attached). Background work
    nobody waits on goes with it (`busy_reasons`): a restore computes its entries again."""
    busy = busy_reasons(core, name)
    if busy:
        raise SessionError(f"session {name!r} is not idle ({', '.join(busy)}); evict it later")
    state = export_session(core, name)
    state.meta["dropped_work"] = droppable_work(core, name)
    core.close_session(name, evicting=True)
    return state


def import_session(core: EngineCore, state: SessionState, name: str, gates: list[tuple[QuestionSpec, Gate, list[int]]]) -> SessionInfo:
    """Open `name` from `state`: reserve its working set (or its cells, if more), copy the cells back in
    the runs they had, register its questions.

    gates: (spec, gate, prompt_ids) per standing question, built by the caller (tokenizer work)."""
    meta = state.meta
    if name in core.sessions:
        raise SessionError(f"session {name!r} is already open; close it or restore under another name")
    manager, pool = core.store.manager, core.store.pool
    n, max_context = int(meta["num_computed"]), int(meta["max_context"])
    working_set = core.admission.working_set(int(meta["prefix_len"]), max_context)
    cells = max(working_set, n)  # its cells come back at once, in one reserved run when the pool has one
    core.admit(name, cells, max_context, "restore")
    table = BlockTable()
    manager.reserve(table, cells)
    runs = meta.get("runs")  # a layout hint (older snapshots have none): unusable ones are ignored
    if isinstance(runs, list) and all(type(r) is int for r in runs) and sum(runs) == n:
        manager.lay_out(table, runs)
    try:
        manager.append(table, n)
    except KVCapacityError:
        manager.free(table)
        raise
    table.grow_to = max_context  # from here on it grows as any session does
    for pos, slot, count in manager.runs(table, n):  # run by run: slice copies, not an index scatter
        pool.k.narrow(2, slot, count).copy_(state.k.narrow(2, pos, count))
        pool.v.narrow(2, slot, count).copy_(state.v.narrow(2, pos, count))
    s = Session(name, meta["system"], state.token_ids[: meta["prefix_len"]], max_context, table,
                str(meta.get("tenant", "")), working_set=working_set)
    s.token_ids = list(state.token_ids)
    s.num_computed = n
    s.version_base = int(meta.get("version_base", 0))
    s.version_ends, s.version_lines = list(meta["version_ends"]), list(meta["version_lines"])
    s.line_ends.extend(meta["line_ends"])
    s.lines_cut = int(meta.get("lines_cut", 0))
    s.taps = core.taps.new_taps() if core.taps_on_open or state.line_features is not None else None
    if s.taps is not None and state.line_features is not None:  # series heads answer at once, not K lines later
        device = core.runner.model.device
        for i, f in zip(state.line_index.tolist(), state.line_features, strict=True):
            s.taps.lines.append((int(i), f.to(device)))
    s.data_version, s.lines_ingested = int(meta["data_version"]), int(meta["lines_ingested"])
    s.compactions, s.tokens_dropped = int(meta["compactions"]), int(meta["tokens_dropped"])
    core.adopt(s)
    saved = meta.get("calibration") or {}
    learned = meta.get("learned") or {}
    for spec, gate, prompt_ids in gates:
        st = core.register_standing(s, spec, gate, prompt_ids)
        if spec.id in saved:  # checked by the snapshot's reader; a window from memory is our own
            st.calibration.restore(saved[spec.id], gate.effective_threshold)
            core.prepos.sync_gate(st)
        if st.learner is not None and spec.id in learned:
            prefix = f"learned/{spec.id}/"
            width = series_width(core.runner.model.config.hidden_size, len(core.taps.words))
            try:
                head = st.learner.restore(learned[spec.id], {k.removeprefix(prefix): t for k, t in state.learned.items()
                                                             if k.startswith(prefix)},
                                          question_id=spec.id, text=spec.text, width=width)
            except ValueError as exc:  # derived state: the question learns again from its next truths
                log.warning("session %r: %s; it learns again from scratch", name, exc)
                head = None
            if head is not None:
                st.gate.head = head.to(core.runner.model.device, torch.float32)
    core.publisher.mark(name)
    core.compactor.maybe_start(s)  # restored with more pending than its budget: compaction makes the room
    return s.info()

