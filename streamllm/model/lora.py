"""LoRA adapters made by `streamllm tune --method lora`: the model itself adapted.

The adapter is peft's own format (adapter_config.json + adapter_model.safetensors under
ADAPTER_DIR/lora/), so any peft tool reads it. peft builds, saves and merges it: LoRA
variants (rank-stabilized scaling, DoRA, per-layer ranks) are peft's to get right, not
ours to re-implement. At load the low-rank update is merged into the weights
(W + scale * B @ A), so serving pays nothing per step: the engine's forward, KV cells and
fast path are those of a plain model with other weights.

Training runs on transformers' Llama modules (autograd, sdpa with an explicit mask for
many decision points packed into one sequence); serving on our forward. The two agree
to fp32 rounding (tests/test_tune_lora.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from streamllm.model.errors import AdapterError

LORA_DIR = "lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraError(AdapterError):
    """A LoRA adapter that cannot be built or loaded."""


def _peft():
    try:
        import peft
    except ImportError:
        raise LoraError("LoRA adapters need peft: pip install 'streamllm[tune]'") from None
    return peft


def hf_model(loaded: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' Llama with the loaded weights (tied embeddings tied), sdpa attention, eval mode."""
    from transformers import AutoModelForCausalLM

    config = type(loaded.config).from_dict(loaded.config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    state = dict(loaded.state_dict)
    # Copies: peft merges in place, and the loaded weights are shared (the engine, other trainers).
    model.load_state_dict({k: v.to(dtype, copy=True) for k, v in state.items()}, strict=False, assign=True)
    if "lm_head.weight" not in state:  # tied embeddings stay tied
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise LoraError(f"model {loaded.name}: weights missing for {missing[:3]}")
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # buffers were on meta
    return model.eval()


def attach_lora(model: torch.nn.Module, *, layers: list[int], rank: int, alpha: float, dropout: float = 0.0,
                seed: int = 0) -> torch.nn.Module:
    """peft's LoRA on every projection of `layers` (the lower ones stay frozen and adapter-free)."""
    peft = _peft()
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(TARGETS),
                             layers_to_transform=layers, bias="none")
    return peft.get_peft_model(model, config)


def save_lora(peft_model: torch.nn.Module, directory: Path) -> Path:
    out = Path(directory) / LORA_DIR
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def has_lora(directory: str | Path) -> bool:
    return (Path(directory) / LORA_DIR / "adapter_config.json").is_file()


def lora_digest(directory: str | Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        path = Path(directory) / LORA_DIR / name
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def lora_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / LORA_DIR / "streamllm.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {directory}: no readable {LORA_DIR}/streamllm.json ({exc})") from None


def merged_state_dict(loaded: Any, directory: str | Path) -> dict[str, torch.Tensor]:
    """The loaded model's weights with the adapter merged in (HF names, fp32, CPU; tied head dropped if unchanged)."""
    peft = _peft()
    path = Path(directory) / LORA_DIR
    model = hf_model(loaded)
    try:
        merged = peft.PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise LoraError(f"adapter {directory}: cannot load the LoRA in {path} ({exc})") from None
    new = merged.state_dict()
    return {k: (new[k].detach().float().contiguous() if k in new else v) for k, v in loaded.state_dict.items()}
