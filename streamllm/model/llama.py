"""Our forward for the Llama family (Llama, SmolLM2, Qwen2, Mistral), on our KV pool.

RMSNorm, RoPE (every scaling variant transformers knows, via its own rotary class),
GQA, SwiGLU, tied embeddings, optional q/k/v biases (Qwen2). Weights are fused at
load (q|k|v, gate|up) so each layer runs four matmuls over the whole ragged batch;
attention runs per bucket of short sequences or per sequence (attention.py). Parity with
transformers' forward is the test (fp32).

In bf16 (see dtype.py) the weights, the matmuls and the KV cells are bf16, while the
residual stream, RMSNorm, RoPE, the attention's softmax/log-sum-exp merges and the
logits stay fp32. On a CPU each bf16 weight is also packed once into oneDNN's blocked
layout (`_packed`), so a product does not re-pack its weight on every call (same
results, bit for bit). Without packing, steps with few rows may use fp32 copies of some
weights, where the start-up probe found fp32 faster at that row count (`fp32_rows`).
When the checkpoint's layer weights are 4-bit already (the default model's Q4_1 GGUF),
steps with few rows (decode) read 4-bit copies of them instead (int4.py, `int4_rows`), and
a step of one new token per sequence runs its layers in one native call (native.py) with
the same products; the layers' loop in `forward` is the reference it is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from streamllm.model import int4, native
from streamllm.model.attention import (
    GATHER_KEYS,
    SeqAttention,
    attend,
    attend_gathered,
    gathered_members,
    grouped_partials,
    plan_gathered,
    plan_parts,
    shared_keys,
)
from streamllm.model.dtype import DtypeChoice, copy_crossover, fp32_crossover, resolve_dtype

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
WEIGHT_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
PACK_ROWS = 32  # the row count oneDNN blocks a packed weight for; any count runs on it
# Each layer weight kind and the checkpoint weights it stacks (their output rows, in this order).
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


# oneDNN's packed products (what torch.compile's CPU freezing uses), absent from some builds.
_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PACKED_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_BF16_SUPPORTED = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype can be packed for oneDNN here (a CPU build with mkldnn; bf16 needs its
    bf16 support). fp32 products of few rows run on packed weights in about half the time of unpacked ones
    on an AVX2-only CPU, and no slower at prefill's row counts."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or None in (_PACK, _PACKED_LINEAR):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and _BF16_SUPPORTED is not None and bool(_BF16_SUPPORTED())


@dataclass(slots=True)
class ForwardBatch:
    """A ragged batch flattened to rows: every new token of every sequence, in order."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: where each row's K/V goes in the pool
    seqs: list[SeqAttention]
    logit_rows: torch.Tensor  # [R] long: rows whose logits are wanted
    # (shared leading runs, member seq indices): read once for all members (cascade attention)
    groups: list = field(default_factory=list)


class ForwardOut(NamedTuple):
    """What a forward returns when more than logits is asked for."""

    logits: torch.Tensor | None  # [R, vocab] fp32 for logit_rows (None: a forward stopped at its tap layer)
    hidden: torch.Tensor | None  # [R, H] final-normed hidden states of the same rows (choice heads), fp32
    tap: torch.Tensor | None  # [T, H] the residual stream of every row after `tap_layer` layers (series heads), fp32


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaForward:
    """The forward on our KV cells. dtype: "auto" | "float32" | "bfloat16" (or a torch dtype).

    fp32_rows: steps with at most this many rows use fp32 copies of the weights; None
    measures the crossover per weight shape at start-up (bf16 on a CPU only), 0 never.
    int4_rows: the same for 4-bit copies of weights that lie on a Q4 grid (int4.py); None
    measures, 0 never. Weights off the grid never get one. An fp32 model gets them only when its
    dtype was chosen by "auto" (a CPU without fast bf16): few-row steps are bound by reading the
    weights, and a 4-bit copy reads an eighth of the fp32 bytes; asked for fp32, it stays fp32.
    bf16_rows: the same for bf16 copies of the weights without a 4-bit copy (the lm_head), in an
    fp32 model chosen by "auto" only; None measures, 0 never.
    fp32 asked for by name (`is_reference`) multiplies by the checkpoint's weights as they are: no
    copies and no packing (oneDNN's packed fp32 sums in another order than transformers' products).
    native_decode: a step of sequences of one new token each runs every layer in one C++ call
    (native.py) where every layer weight has a 4-bit copy for one row and the module builds here.
    """

    def __init__(self, config, state_dict: dict[str, torch.Tensor], device="cpu", dtype="float32",
                 fp32_rows: int | None = None, int4_rows: int | None = None, bf16_rows: int | None = None,
                 native_decode: bool = True):
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (SwiGLU with silu expected)")
        self.config = config
        self.device = torch.device(device)
        self.dtype_choice: DtypeChoice = resolve_dtype(dtype, self.device)
        self.dtype = self.dtype_choice.dtype  # weights, matmuls and KV cells
        self.kv_dtype = self.dtype  # what the KV pool must hold (KVPool(..., dtype=model.kv_dtype))
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        use_window = getattr(config, "use_sliding_window", True)
        self.sliding_window = getattr(config, "sliding_window", None) if use_window else None

        def w(name: str, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return state_dict[name].to(device=self.device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in state_dict else None

        self.embed = w("model.embed_tokens.weight")
        self.final_norm = w("model.norm.weight", torch.float32)  # norms are applied in fp32
        self.lm_head = maybe("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed  # tied embeddings
        self.layers: list[LayerWeights] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            biases = [maybe(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            fused = {kind: torch.cat([w(p + name + ".weight") for name in names]).contiguous()
                     for kind, names in FUSED.items()}
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight", torch.float32),
                    qkv=fused["qkv"],
                    qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
                    o=fused["o"],
                    post_norm=w(p + "post_attention_layernorm.weight", torch.float32),
                    gate_up=fused["gate_up"],
                    down=fused["down"],
                )
            )
        self.intermediate = self.layers[0].gate_up.shape[0] // 2 if self.layers else 0
        self.gather_keys = GATHER_KEYS  # sequences up to this many keys may be gathered (attention.py); 0: never
        self._packed: dict[tuple[str, int], torch.Tensor] = {}
        # fp32 asked for by name is the reference: the model's own weights, plain products, no copies
        self.is_reference = self.dtype == torch.float32 and self.dtype_choice.requested != "auto"
        if can_pack(self.device, self.dtype) and not self.is_reference:
            # Packed bf16 beat fp32 copies at every row count measured (1 to 256), so with
            # packing the fp32 copies are made only when asked for.
            fp32_rows = 0 if fp32_rows is None else fp32_rows  # (an fp32 model makes none anyway)
            self._packed = {(kind, li): _PACK(self._weight(kind, li), PACK_ROWS)
                            for kind in WEIGHT_KINDS for li in range(1 if kind == "lm_head" else self.num_layers)}
        self.bf16_rows = dict.fromkeys(WEIGHT_KINDS, 0)  # set by _init_bf16_copies, after the 4-bit copies
        self._w16: dict[tuple[str, int], torch.Tensor] = {}
        self._init_fp32_copies(fp32_rows)
        self._init_int4_copies(state_dict, int4_rows)
        self._init_bf16_copies(bf16_rows)
        self._init_rope()
        self._decode_step = self._init_native_decode(native_decode)

    # -- few-row steps in fp32 ----------------------------------------------
    def _init_fp32_copies(self, fp32_rows: int | None) -> None:
        """fp32_rows[kind]: up to this many rows, that product runs on an fp32 copy of the weight."""
        self.fp32_rows = dict.fromkeys(WEIGHT_KINDS, 0)
        self._w32: dict[tuple[str, int], torch.Tensor] = {}
        if self.dtype == torch.float32:
            return
        if fp32_rows is not None:
            self.fp32_rows = dict.fromkeys(WEIGHT_KINDS, max(0, fp32_rows))
        elif self.device.type == "cpu" and self.layers:
            # Time the model's own weights, every layer in turn (cold caches, as in a real step):
            # one weight timed alone stays in cache and flatters fp32.
            self.fp32_rows = fp32_crossover({
                kind: [(self._weight(kind, li).float(), self._weight(kind, li))
                       for li in range(1 if kind == "lm_head" else self.num_layers)]
                for kind in WEIGHT_KINDS})
        for kind, rows in self.fp32_rows.items():
            if rows:
                for li in range(1 if kind == "lm_head" else self.num_layers):
                    self._w32[kind, li] = self._weight(kind, li).float()

    # -- few-row steps from 4-bit weights ------------------------------------
    def _init_int4_copies(self, state_dict: dict[str, torch.Tensor], int4_rows: int | None) -> None:
        """int4_rows[kind]: up to this many rows, that product reads the weight's 4-bit copy.

        A kind gets copies only when every layer's weight lies on a Q4 grid in the checkpoint."""
        self.int4_rows = dict.fromkeys(WEIGHT_KINDS, 0)
        self._w4: dict[tuple[str, int], int4.Int4Weight] = {}
        if int4_rows == 0 or not int4.available(self.device, self.dtype) or not self.layers or self.is_reference:
            return
        copies: dict[str, list[int4.Int4Weight]] = {}
        for kind, names in FUSED.items():
            packed = []
            for li in range(self.num_layers):
                # from the checkpoint's own values: the bf16 copies are rounded off the grid
                weight = int4.pack(torch.cat([state_dict[f"model.layers.{li}.{name}.weight"] for name in names]).float())
                if weight is None:
                    break
                packed.append(weight)
            else:
                copies[kind] = packed
        if not copies:
            return
        # against the products the model runs without them (int4_rows is all 0 so far)
        self._keep_copies(copies, int4_rows, lambda: int4.int4_crossover(copies, self._linear), self.int4_rows, self._w4)

    @staticmethod
    def _keep_copies(copies: dict[str, list], asked: int | None, measure: Callable[[], dict[str, int]],
                     rows_by_kind: dict[str, int], kept: dict[tuple[str, int], object]) -> None:
        """Keep the copies of each kind whose row count, `asked` or else measured, is above 0."""
        found = measure() if asked is None else dict.fromkeys(copies, max(0, asked))
        for kind, rows in found.items():
            if rows:
                rows_by_kind[kind] = rows
                kept.update(((kind, li), w) for li, w in enumerate(copies[kind]))

    # -- few-row steps of an fp32 model from bf16 copies ----------------------
    def _init_bf16_copies(self, bf16_rows: int | None) -> None:
        """bf16_rows[kind]: up to this many rows, that product of an fp32 model reads a bf16 copy (half the
        bytes) of a weight that has no 4-bit copy."""
        if self.dtype != torch.float32 or bf16_rows == 0 or self.is_reference or self.device.type != "cpu":
            return
        kinds = [kind for kind in WEIGHT_KINDS if not self.int4_rows[kind] and (kind == "lm_head" or self.layers)]
        copies = {kind: [self._weight(kind, li).bfloat16() for li in range(1 if kind == "lm_head" else self.num_layers)]
                  for kind in kinds}
        def measure() -> dict[str, int]:  # against the model's own fp32 products (bf16_rows is all 0 so far)
            return {kind: copy_crossover(ws[0].shape[1], len(ws), lambda x, li, kind=kind: self._linear(x, kind, li),
                                         lambda x, li, ws=ws: F.linear(x.bfloat16(), ws[li]).float())
                    for kind, ws in copies.items()}

        self._keep_copies(copies, bf16_rows, measure, self.bf16_rows, self._w16)

    def _init_native_decode(self, wanted: bool):
        """native.py's DecodeStep over this model's weights, or None (the Python forward decodes)."""
        if not wanted or self.dtype != torch.bfloat16 or any(self.int4_rows[kind] < 1 for kind in FUSED):
            return None  # the native step computes on bf16 cells and hidden states
        module = native.load()
        if module is None:
            return None
        layers = self.layers

        def kind(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
            copies = [self._w4[name, li] for li in range(self.num_layers)]
            packed = [self._packed[name, li] for li in range(self.num_layers)] if self._packed else []
            return [w.packed for w in copies], [w.scales_zeros for w in copies], packed, self.int4_rows[name]

        biases = [layer.qkv_bias for layer in layers] if layers[0].qkv_bias is not None else []
        step = module.DecodeStep(
            [layer.input_norm for layer in layers], [layer.post_norm for layer in layers], biases,
            *(kind(name) for name in FUSED), self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
            int4.GROUP, self.eps, self.scale)
        self._native_rows = step.max_rows()
        return step

    @property
    def native_decode(self) -> bool:
        """Whether decode steps (one new token a sequence) run in one native call."""
        return self._decode_step is not None

    @property
    def int4_decode(self) -> bool:
        """Whether one-row steps read 4-bit copies of the layer weights (int4.py)."""
        return any(self.int4_rows[kind] for kind in FUSED)

    def _weight(self, kind: str, li: int) -> torch.Tensor:
        return self.lm_head if kind == "lm_head" else getattr(self.layers[li], kind)

    def _linear(self, x: torch.Tensor, kind: str, li: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T in the weight's dtype; output in that dtype (fp32 on the few-row path)."""
        rows = x.shape[0]
        if 0 < rows <= self.int4_rows[kind]:
            out = int4.linear(x, self._w4[kind, li]).to(self.dtype)
            return out if bias is None else out + bias
        if 0 < rows <= self.fp32_rows[kind]:
            return F.linear(x.float(), self._w32[kind, li], None if bias is None else bias.float())
        if 0 < rows <= self.bf16_rows[kind]:
            out = F.linear(x.bfloat16(), self._w16[kind, li]).float()
            return out if bias is None else out + bias
        packed = self._packed.get((kind, li)) if rows else None
        if packed is not None:
            return _PACKED_LINEAR(x.to(self.dtype), packed, bias, "none", [], "")
        return F.linear(x.to(self.dtype), self._weight(kind, li), bias)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held, fp32, bf16, 4-bit and packed copies included (tied embeddings counted once)."""
        seen = {id(self.embed): self.embed, id(self.lm_head): self.lm_head, id(self.final_norm): self.final_norm}
        for layer in self.layers:
            for t in (layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm, layer.gate_up, layer.down):
                if t is not None:
                    seen[id(t)] = t
        seen.update((id(t), t) for t in [*self._w32.values(), *self._w16.values(), *self._packed.values()])
        seen.update((id(t), t) for w in self._w4.values() for t in (w.packed, w.scales_zeros))
        return sum(t.numel() * t.element_size() for t in seen.values())

    # -- rope ---------------------------------------------------------------
    def _init_rope(self) -> None:
        # transformers' own rotary class computes inv_freq and the attention factor for
        # every rope_type in the config (default, linear, llama3, yarn, longrope, ...).
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(self.config)
        self.rope_type = rotary.rope_type
        self.inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self.rope_scaling = float(rotary.attention_scaling)
        self._cos = torch.empty(0, self.head_dim, device=self.device, dtype=torch.float32)
        self._sin = self._cos
        self._ensure_rope(4096)

    def _ensure_rope(self, max_pos: int) -> None:
        if max_pos <= self._cos.shape[0]:
            return
        n = max(max_pos, 2 * self._cos.shape[0])
        t = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos() * self.rope_scaling
        self._sin = emb.sin() * self.rope_scaling
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one roll instead of a negation and a cat
        half = self.head_dim // 2
        self._sin_signed = torch.cat([-self._sin[:, :half], self._sin[:, half:]], dim=-1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate in fp32 (positions up to 8k need more than bf16's 8 bits), return in the cells' dtype."""
        x = x.float()
        return (x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed).to(self.dtype)

    def shift_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Cached keys [..., D] of positions p as they would be cached at p + delta.

        RoPE turns each pair of a key's dimensions by (position x inv_freq): moving a cached key is one
        more turn, by delta x inv_freq, exact up to rounding (the attention factor some rope types fold
        into cos and sin is already in the key and is kept). Values carry no position and never move."""
        angle = (delta * self.inv_freq.double()).float().to(keys.device)
        cos, sin = angle.cos(), angle.sin()
        half = keys.shape[-1] // 2
        x = keys.float()  # in fp32, as `_rope` turns them
        a, b = x[..., :half], x[..., half:]
        out = torch.empty_like(keys)  # written half by half: no cat, no roll (a third of their time)
        out[..., :half] = a * cos - b * sin
        out[..., half:] = b * cos + a * sin
        return out

    # -- forward ------------------------------------------------------------
    def _rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + self.eps))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                return_hidden: bool = False, tap_layer: int | None = None,
                stop_at_tap: bool = False, between_layers: Callable[[], None] | None = None) -> torch.Tensor | ForwardOut:
        """Run the batch, writing its K/V into the caches; returns fp32 logits [R, vocab] for logit_rows.

        k_cache, v_cache: [layers, Hkv, slots, D] (the KVPool tensors, in self.kv_dtype). With
        return_hidden or tap_layer, returns a ForwardOut: the final-normed hidden states of the
        logit rows (what a choice head reads) and/or the residual stream of every row after the
        first `tap_layer` layers (transformers' hidden_states[tap_layer] below the last layer, where
        transformers' is the normed one; what a series head reads).
        Both are computed anyway, so asking for them costs nothing.

        stop_at_tap: run only the first `tap_layer` layers and return the tap alone (logits None). The
        tap is exactly the full forward's (the same ops on the same rows); the batch's K/V cells of the
        layers above are left unwritten, so nothing may attend to these rows' cells there afterwards
        (a tuning window whose lines alone are wanted: engine sessions never stop early).

        between_layers: called before every layer but the first. It may run other forwards on other
        slots (the engine's questions cut in there); this batch's own cells and rows are not touched.
        """
        if tap_layer is not None and not 0 <= tap_layer <= self.num_layers:
            raise ValueError(f"tap_layer {tap_layer} is outside 0..{self.num_layers}")
        if stop_at_tap and (tap_layer is None or return_hidden):
            raise ValueError("stop_at_tap needs a tap_layer and returns neither logits nor hidden states")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise ValueError(f"KV cells are {k_cache.dtype}/{v_cache.dtype}, the model runs {self.kv_dtype}")
        positions = batch.positions
        max_pos = int(positions.max()) + 1 if positions.numel() else 0
        if self.sliding_window and max_pos > self.sliding_window:
            raise ValueError(
                f"context {max_pos} exceeds the model's sliding window {self.sliding_window}; "
                "set the session's max_context at or below it"
            )
        self._ensure_rope(max_pos)
        native_plan = self._native_runs(batch)
        if native_plan is not None:
            return self._native_forward(batch, native_plan, k_cache, v_cache, return_hidden, tap_layer, stop_at_tap)
        cos = self._cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self._sin_signed[positions].unsqueeze(1)
        num_rows = batch.input_ids.shape[0]
        h = self.embed[batch.input_ids].float()  # the residual stream stays fp32
        nh, nkv, d, g = self.num_heads, self.num_kv_heads, self.head_dim, self.groups
        q_size, kv_size = nh * d, nkv * d
        slots = batch.slot_mapping
        tap = h if tap_layer == 0 else None
        # Which slots each sequence reads, and its causal masks, are the same in every layer: planned once.
        # Short sequences are gathered into fused calls; the rest attend run by run (shared runs once).
        gathered_ids = gathered_members(batch.seqs, batch.groups, self.gather_keys)
        gathered = plan_gathered(batch.seqs, gathered_ids, g, self.dtype, h.device) if gathered_ids else []
        apart = set(range(len(batch.seqs))).difference(gathered_ids)
        groups = [(runs, kept) for runs, members in batch.groups if len(kept := [i for i in members if i in apart]) > 1]
        cascade = {i: len(runs) for runs, members in groups for i in members}  # leading runs a group reads
        parts = {i: plan_parts(batch.seqs[i], g, self.dtype, h.device, skip=cascade.get(i, 0)) for i in sorted(apart)}
        one = len(batch.seqs) == 1 and not gathered
        depth = tap_layer if stop_at_tap else self.num_layers
        for li, layer in enumerate(self.layers[:depth]):
            if between_layers is not None and li:
                between_layers()
            x = self._rmsnorm(h, layer.input_norm)
            qkv = self._linear(x, "qkv", li, layer.qkv_bias)
            # q and k rotate together: [T, Hq + Hkv, D]
            qk = self._rope(qkv[:, : q_size + kv_size].view(num_rows, nh + nkv, d), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, q_size + kv_size :].view(num_rows, nkv, d)
            k_layer, v_layer = k_cache[li], v_cache[li]
            k_layer[:, slots] = k.transpose(0, 1)
            v_layer[:, slots] = v.transpose(0, 1).to(self.dtype)
            # [n, Hkv*g, D] -> [Hkv, g*n, D]: rows ordered (group, token)
            qs = {}
            for i in parts:
                seq = batch.seqs[i]
                qs[i] = (q[seq.q_start : seq.q_start + seq.q_len].reshape(seq.q_len, nkv, g, d).permute(1, 2, 0, 3)
                         .reshape(nkv, g * seq.q_len, d))
            shared = grouped_partials(qs, k_layer, v_layer, groups, self.scale) if groups else {}
            if one:  # a lone sequence's output is the whole step's: no buffer to scatter into
                n = num_rows
                out = attend(qs[0], k_layer, v_layer, parts[0], self.scale, shared.get(0))
                attn = out.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nh, d)
            else:
                attn = torch.empty(num_rows, nh, d, device=h.device, dtype=self.dtype)
                for ga in gathered:
                    out = attend_gathered(q, k_layer, v_layer, ga, g, self.scale)
                    attn.index_copy_(0, ga.out_rows, out.index_select(0, ga.out_sel).to(self.dtype))
                for i, seq_parts in parts.items():
                    seq = batch.seqs[i]
                    n = seq.q_len
                    out = attend(qs[i], k_layer, v_layer, seq_parts, self.scale, shared.get(i))
                    attn[seq.q_start : seq.q_start + n] = out.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nh, d)
            h = h + self._linear(attn.reshape(num_rows, q_size), "o", li)
            x = self._rmsnorm(h, layer.post_norm)
            gate_up = self._linear(x, "gate_up", li)
            h = h + self._linear(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], "down", li)
            if li + 1 == tap_layer:
                tap = h  # a new tensor each layer: keeping the reference is the copy
        return self._finish(h, batch, return_hidden, tap_layer, tap, stop_at_tap)

    def _finish(self, h: torch.Tensor, batch: ForwardBatch, return_hidden: bool, tap_layer: int | None,
                tap: torch.Tensor | None, stop_at_tap: bool) -> torch.Tensor | ForwardOut:
        """The final norm and the logits of the rows asked for, after the last layer."""
        if stop_at_tap:
            return ForwardOut(None, None, tap)
        normed = self._rmsnorm(h[batch.logit_rows], self.final_norm)
        logits = self._linear(normed, "lm_head").float()
        if not return_hidden and tap_layer is None:
            return logits
        return ForwardOut(logits, normed.float() if return_hidden else None, tap)

    def _native_runs(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int]] | None:
        """(slots, runs, bounds) of a batch the native step takes, else None: sequences of one new token
        each, in row order, each one's runs covering its positions in order: sequence b's (first slot,
        count) pairs are runs[2 * bounds[b] : 2 * bounds[b + 1]].

        Sequences that share a first run holding half their keys or more (entries forked off one session)
        stay in Python, whose cascade reads that run once for all; a short shared run (a system prompt)
        is read by each. A native step never calls `between_layers`: it is as short as a step gets."""
        seqs = batch.seqs
        if self._decode_step is None or batch.input_ids.shape[0] != len(seqs) or len(seqs) > self._native_rows:
            return None
        if any(2 * shared_keys(runs) >= seqs[i].q_pos0 + 1 for runs, members in batch.groups for i in members):
            return None
        runs, bounds = [], [0]
        for b, seq in enumerate(seqs):
            if seq.q_len != 1 or seq.q_start != b:
                return None
            covered = 0
            for pos0, slot0, n in seq.runs:
                if pos0 != covered:
                    return None
                runs += (slot0, n)
                covered += n
            if covered != seq.q_pos0 + 1:
                return None
            bounds.append(len(runs) // 2)
        return batch.slot_mapping.tolist(), runs, bounds

    def _native_forward(self, batch: ForwardBatch, plan: tuple[list[int], list[int], list[int]], k_cache: torch.Tensor,
                        v_cache: torch.Tensor, return_hidden: bool, tap_layer: int | None,
                        stop_at_tap: bool) -> torch.Tensor | ForwardOut:
        """The same step as the layers' loop in `forward`, every layer in native code."""
        slots, runs, bounds = plan
        h = self.embed[batch.input_ids].float()  # [B, H], advanced in place
        cos, sin = self._cos[batch.positions], self._sin_signed[batch.positions]
        depth = tap_layer if stop_at_tap else self.num_layers
        split = tap_layer if tap_layer is not None else depth
        tap = None
        for first, last in ((0, split), (split, depth)):
            if first < last:
                self._decode_step.run(h, cos, sin, k_cache, v_cache, slots, runs, bounds, first, last)
            if last == tap_layer and tap is None:
                tap = h.clone()
        return self._finish(h, batch, return_hidden, tap_layer, tap, stop_at_tap)
