"""Checkpoints on disk: the cache layout, reading weights/config/tokenizer, and the checks
that turn a broken or unsupported model into a ModelError saying how to fix it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from streamllm.model import tiny

DEFAULT_SPEC = "smollm2-135m"
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SOURCE_FILE = "streamllm-source.json"
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
