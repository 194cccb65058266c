"""`streamllm tune --method lora`: adapt the model itself to a config's labelled questions.

peft's LoRA on every projection of the top `--lora-layers` layers; the rest is frozen.
Three things make it affordable on a CPU:

- many decision points per forward: a window's session is followed by one block per
  (question, bar), each masked to see the session up to its bar (tuning/packing.py);
- the frozen lower layers run once per window: the hidden states entering the first
  adapted layer are kept (bf16) and every step and epoch starts from them, as does
  every evaluation (they do not depend on the adapter);
- bf16 autocast where the CPU has it (AMX / AVX512-BF16): LoRA weights stay fp32.

Loss on the answer only: cross-entropy over the question's choices, each scored as the
engine's gate scores it (its best candidate first token's logit), at the block's last
row. To keep the model general: a KL term to the base model's next-token distribution
at sampled session rows, and held-out ad-hoc questions (answers computed from the data,
never trained on) judged before and after. Early stopping on the dev range's loss.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from streamllm.config import QuestionSpec
from streamllm.config.labels import parse_label
from streamllm.engine.standing.gate import Gate
from streamllm.model.dtype import resolve_dtype
from streamllm.model.lora import attach_lora, hf_model
from streamllm.tuning.packing import Packed, pack_window

# Ad-hoc questions: never trained on, their answers computed from the data; judged before/after.
ADHOC = (
    ("adhoc_trend_5", "Is the last close higher than the close 5 bars before? Answer up or down.",
     ("up", "down"), "trend_up(n=5)"),
    ("adhoc_above_sma_50", "Is the last close above the average close of the last 50 bars? Answer yes or no.",
     ("yes", "no"), "above_sma(n=50)"),
)
KL_ROWS = 48  # session rows per window where the base model's distribution is kept


def adhoc_questions() -> list[QuestionSpec]:
    return [QuestionSpec(qid, text, choices, label=parse_label(label)) for qid, text, choices, label in ADHOC]


@dataclass(slots=True)
class LoraSettings:
    layers: int = 8  # adapted (top) layers
    rank: int = 8
    alpha: float = 16.0
    lr: float = 3e-4
    points: int = 48  # decision points per step
    kl: float = 0.1
    eval_every: int = 20
    bf16: bool = True


class ChoiceScorer:
    """Choice scores as the engine's gate computes them: per choice, its best candidate token's logit."""

    def __init__(self, questions: list[QuestionSpec], tokenizer: Any) -> None:
        self.ids: dict[str, torch.Tensor] = {}
        self.owner: dict[str, torch.Tensor] = {}
        self.choices = {q.id: len(q.choices) for q in questions}
        for q in questions:
            gate = Gate.for_question(q, tokenizer)
            self.ids[q.id] = gate.candidate_ids
            self.owner[q.id] = torch.tensor(gate.candidate_owner)

    def __call__(self, qid: str, normed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        scores = normed.float() @ lm_head[self.ids[qid]].float().T  # [n, candidates]
        owner = self.owner[qid]
        return torch.stack([scores[:, owner == c].max(1).values for c in range(self.choices[qid])], dim=1)


class LoraTrainer:
    def __init__(self, loaded: Any, settings: LoraSettings, seed: int = 0) -> None:
        self.loaded, self.settings = loaded, settings
        n = loaded.config.num_hidden_layers
        if not 1 <= settings.layers <= n:
            raise ValueError(f"--lora-layers must be in 1..{n}, got {settings.layers}")
        self.split = n - settings.layers
        self.hf = hf_model(loaded)
        self.autocast = settings.bf16 and _bf16_ok()
        self.peft = attach_lora(self.hf, layers=list(range(self.split, n)), rank=settings.rank,
                                alpha=settings.alpha, seed=seed)
        self.params = [p for p in self.peft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=0.0)
        self.step = 0

    @property
    def lm_head(self) -> torch.Tensor:
        return self.hf.lm_head.weight

    def _ctx(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else torch.autocast("cpu", enabled=False)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        model = self.hf.model
        pos = positions[None]
        x = h[None]
        rope = model.rotary_emb(x, pos)
        for layer in model.layers[lo:hi]:
            x = layer(x, attention_mask=mask[None, None], position_ids=pos, position_embeddings=rope)
        return x[0]

    # -- per window, once: the frozen lower layers and the base model's outputs -------------
    @torch.no_grad()
    def prepare(self, packed: Packed, scorer: ChoiceScorer, rng: random.Random) -> None:
        with self.peft.disable_adapter(), self._ctx():
            mask = packed.mask()
            h = self.hf.model.embed_tokens(packed.ids)
            h = self._layers(h, packed.positions, mask, 0, self.split)
            packed.extra["lower"] = h.to(torch.bfloat16) if self.autocast else h  # bf16 halves the cache
            top = self.hf.model.norm(self._layers(h, packed.positions, mask, self.split, len(self.hf.model.layers)))
        rows = sorted(rng.sample(range(1, packed.session_rows), min(KL_ROWS, packed.session_rows - 1)))
        packed.extra["kl_rows"] = torch.tensor(rows, dtype=torch.long)
        packed.extra["base_logp"] = F.log_softmax(top[rows].float() @ self.lm_head.float().T, -1).to(torch.bfloat16)
        packed.extra["base_scores"] = self._scores(packed, top, scorer)

    def _scores(self, packed: Packed, top: torch.Tensor, scorer: ChoiceScorer) -> dict[str, torch.Tensor]:
        last = packed.last_rows
        out = {}
        for qid in dict.fromkeys(b.qid for b in packed.blocks):
            idx = torch.tensor([k for k, b in enumerate(packed.blocks) if b.qid == qid])
            out[qid] = scorer(qid, top[last[idx]], self.lm_head).detach()
        return out

    def _top(self, packed: Packed, lower: torch.Tensor) -> torch.Tensor:
        with self._ctx():
            x = self._layers(lower.float(), packed.positions, packed.mask(), self.split, len(self.hf.model.layers))
            return self.hf.model.norm(x)

    # -- a step --------------------------------------------------------------------------------
    def train_step(self, packed: Packed, scorer: ChoiceScorer, rng: random.Random) -> float:
        blocks = rng.sample(packed.blocks, min(self.settings.points, len(packed.blocks)))
        kl_rows = packed.extra["kl_rows"]
        sub, index = packed.sub(blocks, extra_rows=int(kl_rows.max()) + 1)
        self.peft.train()
        top = self._top(sub, packed.extra["lower"][index])
        last = sub.last_rows
        losses = []
        for qid in dict.fromkeys(b.qid for b in sub.blocks):
            k = [i for i, b in enumerate(sub.blocks) if b.qid == qid]
            scores = scorer(qid, top[last[torch.tensor(k)]], self.lm_head)
            target = torch.tensor([sub.blocks[i].choice for i in k])
            losses.append(F.cross_entropy(scores, target, reduction="sum"))
        loss = torch.stack(losses).sum() / len(sub.blocks)
        if self.settings.kl > 0:
            logp = F.log_softmax(top[kl_rows].float() @ self.lm_head.float().T, -1)
            base = packed.extra["base_logp"].float()
            loss = loss + self.settings.kl * (base.exp() * (base - logp)).sum(-1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        self.peft.eval()
        return loss.item()

    @torch.no_grad()
    def scores(self, packed: Packed, scorer: ChoiceScorer) -> dict[str, torch.Tensor]:
        """The adapted model's choice scores at every block of the window, per question (block order)."""
        return self._scores(packed, self._top(packed, packed.extra["lower"]), scorer)

    # -- checkpoints ------------------------------------------------------------------------
    def lora_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.peft.state_dict().items() if "lora_" in k}

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(state) - set(self.peft.state_dict())
        if missing:
            raise ValueError(f"checkpoint has LoRA weights this model lacks: {sorted(missing)[:3]}")
        self.peft.load_state_dict(state, strict=False)

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"lora": self.lora_state(), "opt": self.opt.state_dict(), "step": self.step, **extra}, tmp)
        tmp.replace(path)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        ck = torch.load(path, weights_only=True)  # tensors, numbers, lists, dicts: no code runs
        self.load_lora_state(ck["lora"])
        self.opt.load_state_dict(ck["opt"])
        self.step = int(ck["step"])
        return ck


def _bf16_ok() -> bool:
    try:
        return resolve_dtype("auto", torch.device("cpu")).dtype == torch.bfloat16
    except (ValueError, RuntimeError):
        return False


def dev_loss(scores: dict[str, torch.Tensor], labels: dict[str, torch.Tensor]) -> float:
    total, n = 0.0, 0
    for qid, s in scores.items():
        total += float(F.cross_entropy(s.float(), labels[qid], reduction="sum"))
        n += len(labels[qid])
    return total / max(n, 1)


def window_labels(packed: Packed) -> dict[str, torch.Tensor]:
    out: dict[str, list[int]] = {}
    for b in packed.blocks:
        out.setdefault(b.qid, []).append(b.choice)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def pack(layout: Any, spec: Any, bars: Any, questions: list[QuestionSpec], stride: int) -> Packed:
    return pack_window(layout, spec.system_prompt, bars, questions, stride, spec.render.changes)


def finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 4)
