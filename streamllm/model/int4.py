"""4-bit weights for few-row steps, when the checkpoint's weights are already 4-bit.

The default model comes as a Q4_1 GGUF: every layer weight is, per block of 32 inputs,
`d * q + m` with q in 0..15. Converted to floats, those values still lie exactly on that
grid, so they can be packed back into 4 bits without losing anything the GGUF had (only
the block's scale and offset are rounded to bf16, as the bf16 path rounds every weight).

A decode step has one row per sequence, and its matrix products are bound by reading the
weights: a 4-bit copy reads a quarter of the bf16 bytes. With more rows the products
become compute-bound and the packed bf16 weights win, so each weight kind gets a row
count up to which its 4-bit copy runs (`int4_crossover`, measured at start-up over every
layer's weights, as `dtype.fp32_crossover` measures fp32 copies).

Only weights found on the grid are packed (`q4_grid` returns None otherwise): a checkpoint
in fp16 or bf16 keeps its bf16 path unchanged, since packing it would lose precision.
torch's CPU kernel computes `(q - 8) * scale + zero` per group, so zero = m + 8 * d.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from streamllm.model.dtype import CROSSOVER_ROWS, copy_crossover

GROUP = 32  # inputs per block: Q4_0 and Q4_1's block size, one of the kernel's group sizes

_TO_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


class Int4Weight(NamedTuple):
    packed: torch.Tensor  # the kernel's layout of q
    scales_zeros: torch.Tensor  # [in / GROUP, out, 2] bf16: (d, m + 8d) per block
    out_features: int


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has the CPU 4-bit kernels and the model runs on a CPU (bf16, or fp32 whose few-row
    steps may round their inputs to bf16: the kernel's fp32 path is slower than an fp32 product)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and None not in (_TO_PACK, _MM)


def q4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [out, in] int32 in 0..15, d [out, in/GROUP], m [out, in/GROUP]) when every block of
    GROUP inputs is exactly d * q + m (fp32 arithmetic), else None."""
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.dtype != torch.float32:
        return None
    out_f, in_f = weight.shape
    blocks = weight.reshape(out_f, in_f // GROUP, GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.where(d > 0, (blocks - low) / torch.where(d > 0, d, 1.0), 0.0).round_().clamp_(0, 15)
    if not torch.equal(q * d + low, blocks):
        return None
    return q.to(torch.int32).reshape(out_f, in_f), d.squeeze(-1), low.squeeze(-1)


def pack(weight: torch.Tensor) -> Int4Weight | None:
    """The 4-bit copy of a float32 weight [out, in] on a Q4 grid, or None when it is not on one."""
    grid = q4_grid(weight)
    if grid is None:
        return None
    q, d, low = grid
    scales_zeros = torch.stack([d.t(), (low + 8 * d).t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(_TO_PACK(q, 1), scales_zeros, weight.shape[0])


def linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [rows, in] @ W.T in bf16 from the 4-bit copy: [rows, out] bf16."""
    return _MM(x.to(torch.bfloat16).contiguous(), weight.packed, GROUP, weight.scales_zeros)


def int4_crossover(weights: dict[str, list[Int4Weight]], bf16_linear: Callable[[torch.Tensor, str, int], object],
                   rows: tuple[int, ...] = CROSSOVER_ROWS) -> dict[str, int]:
    """Per weight kind, the 4-bit copy of each layer's weight: the largest row count at which one pass
    over all of them is 10% faster than `bf16_linear(x, kind, layer)` (the model's own product; 0: never)."""
    return {kind: copy_crossover(copies[0].scales_zeros.shape[0] * GROUP, len(copies),
                                 lambda x, li, kind=kind: bf16_linear(x, kind, li),
                                 lambda x, li, copies=copies: linear(x, copies[li]), torch.bfloat16, rows)
            for kind, copies in weights.items()}
