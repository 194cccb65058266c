"""Attention over paged KV: each sequence's context is a few runs of consecutive slots.

A run is read as a view of the pool (no gather). One run goes straight to SDPA; several
runs (a branch: the session's blocks, then its own) are attended separately and merged
by log-sum-exp, the same merge cascade attention uses for a shared prefix.

Queries are laid out per kv head: [Hkv, g * n, D] (g query heads per kv head, n tokens),
so GQA needs no repeat of K/V: every matmul is batched over kv heads.

Several sequences of one step are attended together (`PaddedGroup`): their keys gathered
from the pool into one [B, L] block (one copy per layer), their queries padded to Q rows,
one SDPA call under an additive mask (causal, and blind to the padding). Groups are chosen
so that padding wastes little (`plan_padded`); a sequence alone, one reading a shared
prefix, or one that fits no group keeps the per-sequence path above. The rounding of a
sequence's output depends on the path and on its group's padded shape (bf16 last bits), not
on anything else in the step.

bf16 cells: the fused kernels accumulate in fp32 and return an fp32 log-sum-exp; our
own partials and the merge compute scores, softmax and weights in fp32 as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass(slots=True)
class SeqAttention:
    """Where one sequence's new tokens sit in the flattened batch and what they attend to."""

    q_start: int  # first row of this sequence in the batch
    q_len: int  # number of new tokens
    q_pos0: int  # position of the first new token
    runs: list[tuple[int, int, int]]  # (first_pos, first_slot, n) covering positions 0..q_pos0+q_len


@dataclass(slots=True)
class AttentionParts:
    """One sequence's attention split into parts, planned once per forward (every layer reads the
    same slots): runs read whole (`unmasked`), and runs holding the new tokens, read under a causal
    mask (`masked`: slot0, n, mask). `finite`: every query sees a key in every part (no empty row),
    so two parts merge in five kernels instead of the general merge."""

    unmasked: list[tuple[int, int]]
    masked: list[tuple[int, int, torch.Tensor | None]]
    finite: bool
    fused_masks: bool  # masks are additive, in the queries' dtype, for the fused CPU kernel


def _causal_mask(q_pos0: int, q_len: int, k_pos0: int, k_len: int, groups: int, device) -> torch.Tensor | None:
    """Boolean keep-mask [g*n, k_len], or None when no key lies after any query."""
    if k_pos0 + k_len - 1 <= q_pos0:
        return None
    q_pos = torch.arange(q_pos0, q_pos0 + q_len, device=device).repeat(groups)
    k_pos = torch.arange(k_pos0, k_pos0 + k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


# CPU flash kernel that also returns the log-sum-exp we need to merge parts (and takes an additive mask).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _unmasked_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q[None], k[None], v[None], 0.0, False, scale=scale)
        return out[0], lse[0].unsqueeze(-1)
    return partial_attention(q, k, v, None, scale)


def plan_parts(seq: SeqAttention, groups: int, dtype: torch.dtype, device, shared: bool = False) -> AttentionParts:
    """Split a sequence's runs into parts (the first run left out when `shared` covers it).

    Keys before the first new token need no mask (every query comes after them): they go
    to the fast kernel whole. Keys of the new tokens themselves need the causal mask; they
    are few (one chunk). On a CPU a masked run whose first key no query precedes goes to
    the fused kernel too, with its mask made once here, not in every layer."""
    fused = _FLASH_CPU is not None and torch.device(device).type == "cpu"
    unmasked: list[tuple[int, int]] = []
    masked: list[tuple[int, int, torch.Tensor | None]] = []
    finite = True
    split = seq.q_pos0 if seq.q_len > 1 else seq.q_pos0 + 1
    for pos0, slot0, n in seq.runs[1:] if shared else seq.runs:
        if pos0 + n <= split:
            unmasked.append((slot0, n))
            continue
        if pos0 < split:  # the run's head needs no mask
            unmasked.append((slot0, split - pos0))
            pos0, slot0, n = split, slot0 + split - pos0, n - (split - pos0)
        keep = _causal_mask(seq.q_pos0, seq.q_len, pos0, n, groups, device)
        every_row_sees_a_key = pos0 <= seq.q_pos0
        finite = finite and every_row_sees_a_key
        if keep is not None and fused and every_row_sees_a_key:
            keep = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, NEG_INF)
        masked.append((slot0, n, keep))
    return AttentionParts(unmasked, masked, finite, fused)


def attend(
    q: torch.Tensor,  # [Hkv, g*n, D]
    k_layer: torch.Tensor,  # [Hkv, slots, D]
    v_layer: torch.Tensor,
    parts: AttentionParts,
    scale: float,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention output [Hkv, g*n, D] for one sequence, over its planned parts.

    With one part there is nothing to merge. `shared` is this sequence's (output, lse) over
    its first run, already computed together with other sequences that share that run
    (grouped prefill)."""
    if shared is None and len(parts.unmasked) + len(parts.masked) == 1:
        # 4-D inputs: SDPA's CPU flash kernel only takes batched input (3-D falls back to math).
        slot0, n, mask = (*parts.unmasked[0], None) if parts.unmasked else parts.masked[0]
        return F.scaled_dot_product_attention(q[None], k_layer[None, :, slot0 : slot0 + n],
                                              v_layer[None, :, slot0 : slot0 + n], attn_mask=mask, scale=scale)[0]
    out = [shared] if shared is not None else []
    out += [_unmasked_partial(q, k_layer[:, s0 : s0 + n], v_layer[:, s0 : s0 + n], scale) for s0, n in parts.unmasked]
    for slot0, n, mask in parts.masked:
        k, v = k_layer[:, slot0 : slot0 + n], v_layer[:, slot0 : slot0 + n]
        if mask is not None and mask.dtype != torch.bool:  # additive: the fused kernel (planned so)
            o, lse = _FLASH_CPU(q[None], k[None], v[None], 0.0, False, attn_mask=mask, scale=scale)
            out.append((o[0], lse[0].unsqueeze(-1)))
        else:
            out.append(partial_attention(q, k, v, mask, scale))
    if len(out) == 2 and parts.finite:
        return merge_two(out[0], out[1]).to(q.dtype)
    return merge_partials(out).to(q.dtype)


def shared_prefix_groups(seqs: list[SeqAttention]) -> list[tuple[tuple[int, int, int], list[int]]]:
    """Sequences whose first run is the same, wholly before their new tokens: they can read it once.

    That is the case of a session's entries (and branches) forked at the same point.
    """
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, seq in enumerate(seqs):
        if seq.runs:
            pos0, slot0, n = seq.runs[0]
            if pos0 + n <= seq.q_pos0:
                groups.setdefault(seq.runs[0], []).append(i)
    return [(run, members) for run, members in groups.items() if len(members) > 1]


def grouped_partials(
    qs: dict[int, torch.Tensor], k_layer: torch.Tensor, v_layer: torch.Tensor,
    groups: list[tuple[tuple[int, int, int], list[int]]], scale: float,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Cascade attention's shared half: every member's queries against the shared run in one call."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for (_, slot0, n), members in groups:
        q = torch.cat([qs[i] for i in members], dim=1)
        o, lse = _unmasked_partial(q, k_layer[:, slot0 : slot0 + n], v_layer[:, slot0 : slot0 + n], scale)
        row = 0
        for i in members:
            rows = qs[i].shape[1]
            out[i] = (o[:, row : row + rows], lse[:, row : row + rows])
            row += rows
    return out


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised-free partial attention: (output normalised within this part, its log-sum-exp), in fp32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # A row that sees no key here has lse = -inf; make its weights 0 instead of NaN.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.matmul(torch.exp(scores - safe_lse), v.float())
    return out, lse


def merge_two(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`merge_partials` of two parts whose log-sum-exps are finite: a's weight is sigmoid(lse_a - lse_b)."""
    weight = torch.sigmoid(a[1].float() - b[1].float())
    out_b = b[0].float()
    return out_b + (a[0].float() - out_b) * weight


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine per-part (output, lse) into the attention over the union of the parts' keys (fp32)."""
    lses = torch.stack([lse.float() for _, lse in parts])  # [P, Hkv, rows, 1]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)
    weights = torch.nan_to_num(weights, nan=0.0)
    out = parts[0][0].float() * weights[0]
    for i in range(1, len(parts)):
        out = out + parts[i][0].float() * weights[i]
    return out


PAD_WASTE = 1.5  # a group's padded query x key area may be this much over its members' own
PAD_SLACK = 4096  # plus this many cells: tiny sequences always group
PAD_MAX_KEYS = 1024  # longer sequences stay on their own (runs read in place, no copy): beyond ~1k keys
# the copy and the padding cost more than the per-sequence calls they save (measured on a CPU)


@dataclass(slots=True)
class PaddedGroup:
    """Sequences attended in one SDPA call: B members, queries padded to Q rows, keys to L.

    Keys are gathered a whole block at a time (a memcpy; slot by slot costs 10-20x more):
    every run of a sequence starts on a block boundary. Padded query rows copy a real row
    and padded keys come from a real block, so nothing reads outside the pool; those keys'
    cells may never have been written (NaN bits: NaN - inf is NaN), so they are zeroed in
    the copy (`pad_keys`) as well as masked. `out_rows` drops the padded rows."""

    members: list[int]  # indices into the step's sequences
    q_rows: int  # Q
    block_size: int
    key_blocks: torch.Tensor  # [B*L/block_size] long: the pool block behind each padded block of keys
    q_index: torch.Tensor  # [B*Q] long: the batch row behind each padded query row
    mask: torch.Tensor  # [B, 1, g*Q, L] additive, in the queries' dtype; rows ordered (group, token)
    pad_keys: torch.Tensor | None  # [B, 1, L, 1] bool: key positions past a member's own; None: none are
    out_rows: torch.Tensor | None  # [n] long: the real rows among B*Q, in member order; None: all are real
    rows: torch.Tensor  # [n] long: where those rows go in the batch


def _blocks(seq: SeqAttention, block_size: int) -> list[int] | None:
    """The pool blocks holding a sequence's keys in order, or None where a run starts mid-block."""
    out: list[int] = []
    for pos0, slot0, n in seq.runs:
        if pos0 % block_size or slot0 % block_size:
            return None
        out.extend(range(slot0 // block_size, (slot0 + n - 1) // block_size + 1))
    return out


def plan_padded(seqs: list[SeqAttention], groups: int, dtype: torch.dtype, device, block_size: int,
                skip: set[int] = frozenset(), waste: float | None = None, slack: int | None = None,
                max_keys: int | None = None) -> list[PaddedGroup]:
    """Groups of at least two sequences (not in `skip`) whose padding stays within `waste`.

    Sorted by (new tokens, keys), a sequence joins the open group while the group's padded
    area B x Q x L (queries x keys: the kernel's work) and its padded keys B x L (the copy)
    stay within `waste` times its members' own plus `slack`; otherwise it opens the next one."""
    waste = PAD_WASTE if waste is None else waste
    slack = PAD_SLACK if slack is None else slack
    max_keys = PAD_MAX_KEYS if max_keys is None else max_keys
    blocks = {i: _blocks(seqs[i], block_size) for i in range(len(seqs))
              if i not in skip and seqs[i].q_pos0 + seqs[i].q_len <= max_keys}
    order = sorted((i for i, b in blocks.items() if b is not None),
                   key=lambda i: (seqs[i].q_len, seqs[i].q_pos0 + seqs[i].q_len))
    chosen: list[list[int]] = []
    current: list[int] = []
    q_max = k_max = area = keys = 0
    for i in order:
        q, k = seqs[i].q_len, len(blocks[i]) * block_size
        qm, km, b = max(q_max, q), max(k_max, k), len(current) + 1
        if current and (b * qm * km > waste * (area + q * k) + slack or b * km > waste * (keys + k) + slack):
            chosen.append(current)
            current, qm, km, area, keys = [], q, k, 0, 0
        current.append(i)
        q_max, k_max, area, keys = qm, km, area + q * k, keys + k
    chosen.append(current)
    return [_padded_group(seqs, members, [blocks[i] for i in members], groups, dtype, device, block_size)
            for members in chosen if len(members) > 1]


def _padded_group(seqs: list[SeqAttention], members: list[int], blocks: list[list[int]], groups: int,
                  dtype: torch.dtype, device, block_size: int) -> PaddedGroup:
    q_rows = max(seqs[i].q_len for i in members)
    width = max(len(b) for b in blocks)
    q_index, rows, out_rows, q_pos0 = [], [], [], []
    for b, i in enumerate(members):
        seq = seqs[i]
        own = torch.arange(seq.q_start, seq.q_start + seq.q_len)
        q_index.append(torch.cat([own, own[-1:].expand(q_rows - seq.q_len)]))
        rows.append(own)
        out_rows.append(torch.arange(b * q_rows, b * q_rows + seq.q_len))
        q_pos0.append(seq.q_pos0)
    key_blocks = torch.tensor([bl + bl[:1] * (width - len(bl)) for bl in blocks]).flatten()
    keys = width * block_size
    q_pos = torch.tensor(q_pos0)[:, None] + torch.arange(q_rows)  # [B, Q]; padded rows see every key of theirs
    keep = torch.arange(keys)[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
    b = len(members)
    keep = keep[:, None].expand(b, groups, q_rows, keys).reshape(b, 1, groups * q_rows, keys)
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, NEG_INF).to(device)
    ends = torch.tensor([seqs[i].q_pos0 + seqs[i].q_len for i in members])
    pad_keys = (torch.arange(keys)[None, :] >= ends[:, None])[:, None, :, None]
    out = torch.cat(out_rows)
    return PaddedGroup(members, q_rows, block_size, key_blocks.to(device), torch.cat(q_index).to(device), mask,
                       pad_keys.to(device) if pad_keys.any() else None,
                       None if out.numel() == b * q_rows else out.to(device), torch.cat(rows).to(device))


def attend_padded(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, group: PaddedGroup,
                  scale: float) -> torch.Tensor:
    """Attention output [n, Hq, D] of a group's real rows, from the step's queries q [T, Hq, D]."""
    hkv, slots, d = k_layer.shape
    b, qn, bs = len(group.members), group.q_rows, group.block_size
    keys = group.key_blocks.numel() // b * bs
    g = q.shape[1] // hkv
    # [B*Q, Hkv*g, D] -> [B, Hkv, g*Q, D]: rows ordered (group, token), as the mask's
    qp = q.index_select(0, group.q_index).view(b, qn, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * qn, d)
    whole = slots - slots % bs

    def gather(cells: torch.Tensor) -> torch.Tensor:
        by_block = cells[:, :whole].view(hkv, whole // bs, bs * d)
        out = by_block.index_select(1, group.key_blocks).view(hkv, b, keys, d).transpose(0, 1)
        return out if group.pad_keys is None else out.masked_fill_(group.pad_keys, 0.0)

    out = F.scaled_dot_product_attention(qp, gather(k_layer), gather(v_layer), attn_mask=group.mask, scale=scale)
    out = out.view(b, hkv, g, qn, d).permute(0, 3, 1, 2, 4).reshape(b * qn, hkv * g, d)
    return out if group.out_rows is None else out.index_select(0, group.out_rows)
