"""Session snapshots: a session's KV cells and bookkeeping in one file, restored into an engine.

    snapshot file (safetensors):  k, v          [layers, kv_heads, num_computed, head_dim]
                                  token_ids     [num_tokens] int64
                                  __metadata__  {"streamllm": JSON}  versions, prefix, questions,
                                                config hash, sha256 of the tensors

Written to a temp file beside the target, fsynced, then renamed over it: a reader sees
the old snapshot or the new one, never half of one. Restore checks everything before it
allocates a cell (like llama.cpp's slot restore refusing a mismatched file): the format
version, the model (name + config + tokenizer vocabulary hash), the tensors' checksum and
shapes, the token count and the version bookkeeping. Any mismatch raises `SnapshotError`
naming the problem; the engine is untouched.

Only cells of computed tokens are saved; tokens pushed but not yet ingested travel as
ids and are ingested after restore like any pending batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from streamllm.config import ConfigError, QuestionSpec, parse_question
from streamllm.engine.kv import BlockTable, KVCapacityError
from streamllm.engine.sequence import Session

FORMAT = "streamllm-session-snapshot"
FORMAT_VERSION = 1
_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SnapshotError(ValueError):
    """A snapshot that cannot be written or restored; the message names the file and the problem."""


@dataclass(slots=True)
class SnapshotInfo:
    path: str
    session: str
    num_tokens: int
    num_computed: int
    data_version: int
    bytes: int
    seconds: float


def question_dict(spec: QuestionSpec) -> dict[str, Any]:
    """A standing question in the form `parse_question` reads back (logs, snapshots)."""
    out: dict[str, Any] = {"id": spec.id, "text": spec.text, "threshold": spec.threshold,
                           "max_tokens": spec.max_tokens, "push": spec.push}
    if spec.choices:
        out["choices"] = list(spec.choices)
    if spec.label is not None:
        out["label"] = spec.label.text
    return out


def config_hash(engine: Any) -> str:
    """Model name, architecture and tokenizer vocabulary: cells are only valid for the same ones."""
    cached = _HASHES.get(engine)
    if cached is not None:
        return cached
    m = engine.model
    arch = {"name": engine.model_name, "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "vocab": m.vocab_size, "dtype": str(m.dtype),
            "config": m.config.to_dict() if hasattr(m.config, "to_dict") else str(m.config)}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted(engine.tokenizer.get_vocab().items())).encode())
    _HASHES[engine] = digest = h.hexdigest()
    return digest


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_session(engine: Any, name: str, path: str | Path) -> SnapshotInfo:
    """Write session `name` to `path` (atomically). The session keeps running."""
    t0 = time.perf_counter()
    path = Path(path)
    manager, pool = engine.store.manager, engine.store.pool
    with engine._cv:  # cells below num_computed are final: copy them while nothing can move the table
        s: Session = engine._session(name)
        n = s.num_computed
        slots = manager.slots(s.table, 0, n).to(pool.k.device)
        k = pool.k[:, :, slots].to("cpu", copy=True)
        v = pool.v[:, :, slots].to("cpu", copy=True)
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "config_hash": config_hash(engine),
            "model": engine.model_name, "adapter": getattr(engine, "adapter_id", None), "session": s.name, "system": s.system, "max_context": s.max_context,
            "prefix_len": s.prefix_len, "num_tokens": s.num_tokens, "num_computed": n,
            "version_ends": s.version_ends, "version_lines": s.version_lines, "line_ends": s.line_ends,
            "data_version": s.data_version, "lines_ingested": s.lines_ingested, "compactions": s.compactions,
            "tokens_dropped": s.tokens_dropped,
            "questions": [question_dict(st.spec) for st in engine.prepos.standing(name)],
        }
        token_ids = torch.tensor(s.token_ids, dtype=torch.int64)
    tensors = {"k": k.contiguous(), "v": v.contiguous(), "token_ids": token_ids}
    meta["sha256"] = _tensor_digest(tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"streamllm": json.dumps(meta)})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(f"snapshot {path}: cannot write: {exc}") from exc
    return SnapshotInfo(str(path), name, len(token_ids), n, meta["data_version"], path.stat().st_size,
                        time.perf_counter() - t0)


@dataclass(slots=True)
class LoadedSnapshot:
    meta: dict[str, Any]
    k: torch.Tensor
    v: torch.Tensor
    token_ids: list[int]
    questions: list[QuestionSpec]


def load_snapshot(engine: Any, path: str | Path) -> LoadedSnapshot:
    """Read and validate a snapshot against `engine`; SnapshotError names what is wrong."""
    path = Path(path)

    def bad(problem: str) -> SnapshotError:
        return SnapshotError(f"snapshot {path}: {problem}; not restored")

    if not path.is_file():
        raise bad("no such file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise bad(f"not a readable safetensors file ({exc})") from None
    try:
        meta = json.loads(header["streamllm"])
    except (KeyError, TypeError, ValueError):
        raise bad("no streamllm metadata (not a session snapshot)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad("not a session snapshot")
    if meta.get("format_version") != FORMAT_VERSION:
        raise bad(f"format version {meta.get('format_version')!r}, this build reads {FORMAT_VERSION}")
    if meta.get("config_hash") != config_hash(engine):
        raise bad(f"written by model {meta.get('model')!r} with another config or tokenizer; this engine runs "
                  f"{engine.model_name!r}")
    if meta.get("adapter") != getattr(engine, "adapter_id", None):
        raise bad(f"written under adapter {meta.get('adapter')!r}; this engine runs adapter "
                  f"{getattr(engine, 'adapter_id', None)!r} (its standing answers would not be the same)")
    if set(tensors) != {"k", "v", "token_ids"}:
        raise bad(f"tensors {sorted(tensors)}, expected k, v, token_ids")
    if _tensor_digest(tensors) != meta.get("sha256"):
        raise bad("checksum mismatch: the cells or token ids are corrupted")
    k, v, ids = tensors["k"], tensors["v"], tensors["token_ids"]
    m = engine.model
    try:
        n, num_tokens, prefix_len = int(meta["num_computed"]), int(meta["num_tokens"]), int(meta["prefix_len"])
        ends, lines, version = list(meta["version_ends"]), list(meta["version_lines"]), int(meta["data_version"])
        max_context = int(meta["max_context"])
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"metadata field missing or mistyped ({exc})") from None
    want = (m.num_layers, m.num_kv_heads, n, m.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise bad(f"cells shaped {tuple(k.shape)}, expected {want} for {n} computed tokens")
    if ids.ndim != 1 or len(ids) != num_tokens:
        raise bad(f"{len(ids)} token ids, the metadata says {num_tokens}")
    if not prefix_len <= n <= num_tokens <= max_context:
        raise bad(f"token counts out of order: prefix {prefix_len}, computed {n}, tokens {num_tokens}, "
                  f"max_context {max_context}")
    if len(ends) != len(lines) or not ends or ends[-1] != num_tokens or ends != sorted(ends):
        raise bad(f"version bookkeeping inconsistent: {len(ends)} ends, {len(lines)} line counts, last end "
                  f"{ends[-1] if ends else None} vs {num_tokens} tokens")
    if not 0 <= version < len(ends) or ends[version] > n:
        raise bad(f"data_version {version} is not computed ({n} computed tokens)")
    try:
        questions = [parse_question(q, source=str(path), key_path=f"questions[{i}]")
                     for i, q in enumerate(meta.get("questions", []))]
    except ConfigError as exc:
        raise bad(f"standing question does not parse: {exc}") from None
    return LoadedSnapshot(meta, k, v, ids.tolist(), questions)


def restore_session(engine: Any, path: str | Path, name: str | None = None) -> SnapshotInfo:
    """Allocate a table, copy the cells back and register the session (and its standing questions)."""
    t0 = time.perf_counter()
    snap = load_snapshot(engine, path)
    meta = snap.meta
    name = name or meta["session"]
    manager, pool = engine.store.manager, engine.store.pool
    n, max_context = meta["num_computed"], meta["max_context"]
    with engine._cv:
        if name in engine.sessions:
            raise SnapshotError(f"snapshot {path}: session {name!r} is already open; close it or restore under "
                                "another name")
        spare = manager.num_free_blocks - manager.blocks_for(max_context)
        if spare < manager.blocks_for(engine.branch_cells):
            engine.admissions_refused += 1
            raise KVCapacityError(f"cannot restore session {name!r}: it reserves {max_context} cells, the pool has "
                                  f"{manager.num_free_blocks * manager.block_size} free")
        table = BlockTable()
        manager.reserve(table, max_context)
        slots = manager.append(table, n).to(pool.k.device)
        pool.k[:, :, slots] = snap.k.to(pool.k.device, pool.k.dtype)
        pool.v[:, :, slots] = snap.v.to(pool.v.device, pool.v.dtype)
        s = Session(name, meta["system"], snap.token_ids[: meta["prefix_len"]], max_context, table)
        s.token_ids = snap.token_ids
        s.num_computed = n
        s.version_ends, s.version_lines = list(meta["version_ends"]), list(meta["version_lines"])
        s.line_ends = list(meta["line_ends"])
        s.data_version, s.lines_ingested = meta["data_version"], meta["lines_ingested"]
        s.compactions, s.tokens_dropped = meta["compactions"], meta["tokens_dropped"]
        engine.sessions[name] = s
        for spec in snap.questions:
            engine.prepos.register(s, spec)
        engine._cv.notify_all()
    return SnapshotInfo(str(path), name, len(snap.token_ids), n, meta["data_version"], Path(path).stat().st_size,
                        time.perf_counter() - t0)


def evict_session(engine: Any, name: str, directory: str | Path) -> str:
    """Snapshot an idle session and free its cells; `restore_evicted` brings it back on next use.

    Refused while the session has work in flight (pending ingest, questions, compaction):
    eviction is for idle sessions. Subscribers stay attached and hear it again after restore.
    """
    from streamllm.durability.ingest_log import session_dir_name

    path = Path(directory) / f"{session_dir_name(name)}.safetensors"
    with _EVICTION, engine._cv:  # nothing may push between the snapshot and the drop
        s: Session = engine._session(name)
        busy = [why for why, cond in (
            ("pending ingest", s.pending_tokens > 0),
            ("questions in flight", any(b.session is s for b in engine._running + engine._waiting)),
            ("compaction running", name in engine._compactions),
            ("entries computing", any(st.computing is not None or st.decoding is not None or st.waiters
                                      for st in engine.prepos.standing(name))),
        ) if cond]
        if busy:
            raise SnapshotError(f"session {name!r} is not idle ({', '.join(busy)}); evict it later")
        save_session(engine, name, path)
        engine._drop_session(name, evicting=True)
        engine._evicted[name] = str(path)
    return str(path)


def restore_evicted(engine: Any, name: str) -> None:
    """Bring an evicted session back (first caller restores, concurrent ones find it resident)."""
    with _EVICTION:
        path = engine._evicted.get(name)
        if path is None:
            return
        restore_session(engine, path, name)
        del engine._evicted[name]
    Path(path).unlink(missing_ok=True)


_EVICTION = threading.RLock()
