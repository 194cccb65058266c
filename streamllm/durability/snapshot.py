"""Session snapshots: a session's KV cells and bookkeeping in one file, restored into an engine.

    snapshot file (safetensors):  k, v          [layers, kv_heads, num_computed, head_dim]
                                  token_ids     [num_tokens] int64
                                  line_features [n, (2 + W) H], line_index [n]  (series heads only, engine/taps.py)
                                  learned/<question>/...  (live learning: a head, its samples and lines)
                                  __metadata__  {"streamllm": JSON}  versions, prefix, questions,
                                                dtype, config hash, sha256 of the tensors

Written to a temp file beside the target, fsynced, then renamed over it and the folder
fsynced: a reader sees the old snapshot or the new one, never half of one, and a power
loss after the call returns keeps the new one. A spill (`durable=False`) is renamed the
same way without the fsyncs: it caches a live session, and recovery never reads it.
Restore checks everything before it allocates a cell (like llama.cpp's slot restore
refusing a mismatched file): the format
version, the cells' dtype (a bf16 snapshot is not restored into an fp32 engine or back: the
cells would not be what that engine computes), the model (name + config + tokenizer vocabulary
hash), the tensors' checksum and
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from streamllm.config import ConfigError, QuestionSpec, parse_question
from streamllm.durability.files import durable_rename, make_dirs
from streamllm.durability.ingest_log import legacy_tenant, session_dir_name
from streamllm.engine.outputs import EngineIdentity, SessionError, SessionInfo
from streamllm.engine.standing.calibration import read_window
from streamllm.engine.state import SessionState

FORMAT = "streamllm-session-snapshot"
FORMAT_VERSION = 1


class StateEngine(Protocol):
    """What snapshots need of an engine: its identity and a session's state out and in
    (`Engine`, and `ResidentEngine` over one)."""

    @property
    def model_name(self) -> str: ...

    @property
    def ingest_log(self) -> Any: ...

    def identity(self) -> EngineIdentity: ...

    def export_session(self, name: str) -> SessionState: ...

    def import_session(self, state: SessionState, name: str) -> SessionInfo: ...


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


def snapshot_path(directory: str | Path, name: str) -> Path:
    """Where a session is written in a folder of snapshots (evictions, spills)."""
    return Path(directory) / f"{session_dir_name(name)}.safetensors"


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].contiguous().view(torch.uint8).numpy())  # the buffer itself, not a bytes copy
    return h.hexdigest()


def save_session(engine: StateEngine, name: str, path: str | Path) -> SnapshotInfo:
    """Write session `name` to `path` (atomically). The session keeps running.

    The core copies the cells (between two steps); hashing, writing and fsync happen here,
    in the caller's thread, never on the core or an event loop."""
    t0 = time.perf_counter()
    return write_state(engine, engine.export_session(name), Path(path), t0)


def write_state(engine: StateEngine, state: SessionState, path: Path, t0: float | None = None,
                extra: dict[str, Any] | None = None, *, durable: bool = True) -> SnapshotInfo:
    """Write an exported state to `path` (temp file, fsync, rename, fsync the folder).

    durable=False (a spill: a cache of a live session that recovery never reads, docs/reliability.md)
    skips both fsyncs: the rename still means a reader in this process sees the whole file or none."""
    t0 = time.perf_counter() if t0 is None else t0
    ident = engine.identity()
    meta = dict(state.meta)
    meta.update(extra or {})
    meta.update({"format": FORMAT, "format_version": FORMAT_VERSION, "config_hash": ident.config_hash,
                 "model": ident.model_name, "dtype": ident.kv_dtype, "adapter": ident.adapter_id,
                 "questions": [q.to_dict() for q in state.questions]})
    token_ids = torch.tensor(state.token_ids, dtype=torch.int64)
    tensors = {"k": state.k.contiguous(), "v": state.v.contiguous(), "token_ids": token_ids}
    if state.line_features is not None:  # series heads' line features (optional: older files have none)
        tensors["line_features"] = state.line_features.contiguous()
        tensors["line_index"] = state.line_index.contiguous()
    tensors.update({k: t.contiguous() for k, t in state.learned.items()})  # "learned/<question>/<name>"
    meta["sha256"] = _tensor_digest(tensors)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        make_dirs(path.parent)
        save_file(tensors, str(tmp), metadata={"streamllm": json.dumps(meta)})
        if durable:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            durable_rename(tmp, path)  # the folder is fsynced too: the new name survives a power loss
        else:
            os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(f"snapshot {path}: cannot write: {exc}") from exc
    return SnapshotInfo(str(path), meta["session"], len(token_ids), meta["num_computed"], meta["data_version"],
                        path.stat().st_size, time.perf_counter() - t0)


@dataclass(slots=True)
class LoadedSnapshot:
    meta: dict[str, Any]
    k: torch.Tensor
    v: torch.Tensor
    token_ids: list[int]
    questions: list[QuestionSpec]
    line_features: torch.Tensor | None = None
    line_index: torch.Tensor | None = None
    learned: dict[str, torch.Tensor] = field(default_factory=dict)


def load_snapshot(engine: StateEngine, path: str | Path) -> LoadedSnapshot:
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
    # Snapshots written before dtypes were recorded hold fp32 cells.
    ident = engine.identity()
    written, running = meta.get("dtype", "float32"), ident.kv_dtype
    if written != running:
        raise bad(f"cells are {written}, this engine runs {running}; restore it into an engine started with "
                  f"dtype={written!r}")
    if meta.get("config_hash") != ident.config_hash:
        raise bad(f"written by model {meta.get('model')!r} with another config or tokenizer; this engine runs "
                  f"{ident.model_name!r}")
    if meta.get("adapter") != ident.adapter_id:
        raise bad(f"written under adapter {meta.get('adapter')!r}; this engine runs adapter "
                  f"{ident.adapter_id!r} (its standing answers would not be the same)")
    learned = {k: t for k, t in tensors.items() if k.startswith("learned/")}  # live learning's (engine/standing/learning.py)
    if set(tensors) - set(learned) not in ({"k", "v", "token_ids"}, {"k", "v", "token_ids", "line_features", "line_index"}):
        raise bad(f"tensors {sorted(tensors)}, expected k, v, token_ids (and line_features, line_index, learned/...)")
    if _tensor_digest(tensors) != meta.get("sha256"):
        raise bad("checksum mismatch: the cells or token ids are corrupted")
    k, v, ids = tensors["k"], tensors["v"], tensors["token_ids"]
    try:
        n, num_tokens, prefix_len = int(meta["num_computed"]), int(meta["num_tokens"]), int(meta["prefix_len"])
        ends, lines, version = list(meta["version_ends"]), list(meta["version_lines"]), int(meta["data_version"])
        max_context, base = int(meta["max_context"]), int(meta.get("version_base", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"metadata field missing or mistyped ({exc})") from None
    want = (ident.num_layers, ident.num_kv_heads, n, ident.head_dim)
    if k.dtype != v.dtype or str(k.dtype).removeprefix("torch.") != written:
        raise bad(f"cells stored as {k.dtype}/{v.dtype}, the metadata says {written}")
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise bad(f"cells shaped {tuple(k.shape)}, expected {want} for {n} computed tokens")
    if ids.ndim != 1 or len(ids) != num_tokens:
        raise bad(f"{len(ids)} token ids, the metadata says {num_tokens}")
    if not prefix_len <= n <= min(num_tokens, max_context):
        raise bad(f"token counts out of order: prefix {prefix_len}, computed {n}, tokens {num_tokens}, "
                  f"max_context {max_context}")
    if len(ends) != len(lines) or not ends or ends[-1] != num_tokens or ends != sorted(ends):
        raise bad(f"version bookkeeping inconsistent: {len(ends)} ends, {len(lines)} line counts, last end "
                  f"{ends[-1] if ends else None} vs {num_tokens} tokens")
    if not base <= version < base + len(ends) or ends[version - base] > n:
        raise bad(f"data_version {version} is not computed ({n} computed tokens)")
    try:
        questions = [parse_question(q, source=str(path), key_path=f"questions[{i}]", stored=True)
                     for i, q in enumerate(meta.get("questions", []))]
    except ConfigError as exc:
        raise bad(f"standing question does not parse: {exc}") from None
    calibration = meta.get("calibration") or {}
    if not isinstance(calibration, dict):
        raise bad(f"calibration is {type(calibration).__name__}, expected an object per question")
    for qid, saved in calibration.items():  # each window is read now, so a bad one never reaches the core
        try:
            read_window(saved)
        except ValueError as exc:
            raise bad(f"question {qid!r}: {exc}") from None
    features, index = tensors.get("line_features"), tensors.get("line_index")
    width = ident.line_feature_width  # what this engine's taps keep
    if features is not None and (features.ndim != 2 or features.shape[1] != width
                                 or index.shape != (features.shape[0],)):
        raise bad(f"line features shaped {tuple(features.shape)} / {tuple(index.shape)}, expected [n, {width}] / [n]")
    if "tenant" not in meta:  # written before snapshots carried the tenant
        meta["tenant"] = legacy_tenant(str(meta.get("session", "")))
    return LoadedSnapshot(meta, k, v, ids.tolist(), questions, features, index, learned)


def restore_session(engine: StateEngine, path: str | Path, name: str | None = None) -> SnapshotInfo:
    """Validate the file here, then have the core allocate, copy the cells back and register questions.
    With an ingest log, the restore is logged (recovery restores it from the same file)."""
    t0 = time.perf_counter()
    info = restore_loaded(engine, load_snapshot(engine, path), path, name, t0)
    log = engine.ingest_log
    if log is not None:
        log.record_restore(info.session, path, info.data_version)
    return info


def restore_loaded(engine: StateEngine, snap: LoadedSnapshot, path: str | Path, name: str | None = None,
                   t0: float | None = None) -> SnapshotInfo:
    """Restore an already validated snapshot (`load_snapshot`) as session `name` (not logged);
    `AdmissionError` when its budget cannot be had."""
    t0 = time.perf_counter() if t0 is None else t0
    name = name or snap.meta["session"]
    try:
        info = engine.import_session(snapshot_state(snap), name)
    except SessionError as exc:
        raise SnapshotError(f"snapshot {path}: {exc}") from None
    return SnapshotInfo(str(path), name, len(snap.token_ids), info.num_computed, info.data_version,
                        Path(path).stat().st_size, time.perf_counter() - t0)


def snapshot_state(snap: LoadedSnapshot) -> SessionState:
    return SessionState(snap.meta, snap.k, snap.v, snap.token_ids, snap.questions, snap.line_features,
                        snap.line_index, snap.learned)
