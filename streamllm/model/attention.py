"""Attention over paged KV: each sequence's context is a few runs of consecutive slots.

A run is read as a view of the pool (no gather). One run goes straight to SDPA; several
runs (a branch: the session's blocks, then its own) are attended separately and merged
by log-sum-exp, the same merge cascade attention uses for a shared prefix.

Short sequences with few new tokens (a decode step, a question, a standing answer) are
instead gathered: their keys copied, in position order, into one padded batch per length
bucket, attended by one fused call under an additive mask (`plan_gathered`). Below
`GATHER_KEYS` keys the copy costs less than the kernels it saves: one call per bucket and
layer instead of one per run and sequence, and no merge.

Queries are laid out per kv head: [Hkv, g * n, D] (g query heads per kv head, n tokens),
so GQA needs no repeat of K/V: every matmul is batched over kv heads.

bf16 cells: the fused kernels accumulate in fp32 and return an fp32 log-sum-exp; our
own partials and the merge compute scores, softmax and weights in fp32 as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
# Gathered attention (`plan_gathered`): sequences with at most GATHER_QUERIES new tokens and at most
# GATHER_KEYS keys. Past that the copy costs about what the per-sequence calls save (on a CPU, for
# branches of three runs: gathered was faster up to 2,000 keys and level at 3,000).
GATHER_KEYS = 2048
GATHER_QUERIES = 32
GATHER_ALIGN = 32  # a bucket's keys, rounded up to this
# Keys one bucket copies at most (members x keys): the copy is a temporary of K and V, so a step of many
# long sequences is cut into several buckets instead of one large allocation (about 50 MB per layer
# for the default model in bf16).
GATHER_BUCKET_KEYS = 65_536


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


def plan_parts(seq: SeqAttention, groups: int, dtype: torch.dtype, device, skip: int = 0) -> AttentionParts:
    """Split a sequence's runs into parts (its first `skip` runs left out: a cascade group reads them).

    Keys before the first new token need no mask (every query comes after them): they go
    to the fast kernel whole. Keys of the new tokens themselves need the causal mask; they
    are few (one chunk). On a CPU a masked run whose first key no query precedes goes to
    the fused kernel too, with its mask made once here, not in every layer."""
    fused = _FLASH_CPU is not None and torch.device(device).type == "cpu"
    unmasked: list[tuple[int, int]] = []
    masked: list[tuple[int, int, torch.Tensor | None]] = []
    finite = True
    split = seq.q_pos0 if seq.q_len > 1 else seq.q_pos0 + 1
    for pos0, slot0, n in seq.runs[skip:]:
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
    its leading runs, already computed together with other sequences that share them
    (`grouped_partials`)."""
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


Run = tuple[int, int, int]  # (first position, first slot, count)


def shared_prefix_groups(seqs: list[SeqAttention]) -> list[tuple[tuple[Run, ...], list[int]]]:
    """Sequences whose leading runs (every run wholly before their new tokens) are the same: they can
    read them once, as (the shared runs, member indices).

    That is the case of a session's entries (and branches) forked at the same point. The key is all of a
    fork's leading runs, not its first: the first is the system prompt's block that every session shares
    (the prefix cache), which would put every session's entries in one group sharing a few tokens.
    """
    groups: dict[tuple[Run, ...], list[int]] = {}
    for i, seq in enumerate(seqs):
        lead = []
        for run in seq.runs:
            if run[0] + run[2] > seq.q_pos0:
                break
            lead.append(run)
        if lead:
            groups.setdefault(tuple(lead), []).append(i)
    return [(runs, members) for runs, members in groups.items() if len(members) > 1]


def shared_keys(runs: tuple[Run, ...]) -> int:
    """How many keys a group's shared runs hold."""
    return sum(n for _, _, n in runs)


def grouped_partials(
    qs: Mapping[int, torch.Tensor], k_layer: torch.Tensor, v_layer: torch.Tensor,
    groups: list[tuple[tuple[Run, ...], list[int]]], scale: float,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Cascade attention's shared half: every member's queries against the shared runs, one call a run."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for runs, members in groups:
        q = torch.cat([qs[i] for i in members], dim=1)
        parts = [_unmasked_partial(q, k_layer[:, s0 : s0 + n], v_layer[:, s0 : s0 + n], scale) for _, s0, n in runs]
        o, lse = parts[0] if len(parts) == 1 else _merge(parts)
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
    return _merge(parts)[0]


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials`, and the log-sum-exp over all the parts' keys (to merge again)."""
    lses = torch.stack([lse.float() for _, lse in parts])  # [P, Hkv, rows, 1]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)
    weights = torch.nan_to_num(weights, nan=0.0)
    out = parts[0][0].float() * weights[0]
    for i in range(1, len(parts)):
        out = out + parts[i][0].float() * weights[i]
    return out, total


@dataclass(slots=True)
class GatheredAttention:
    """Sequences attended together in one fused call: a bucket of B sequences padded to `queries` new
    tokens and `keys` keys. Planned once per forward; every layer gathers the same slots."""

    members: list[int]  # indices of the sequences in the batch
    key_slots: torch.Tensor  # [B * keys]: each member's slots in position order, padded with its first
    q_rows: torch.Tensor  # [B * queries]: the batch rows of each member's new tokens, padded with its last
    out_rows: torch.Tensor  # [R]: the batch rows written (every member's new tokens)
    out_sel: torch.Tensor  # [R]: where each sits in the padded [B * queries] output
    mask: torch.Tensor | None  # [B, 1, g * queries, keys] additive, in the queries' dtype; None: no key masked
    queries: int
    keys: int


def gathered_members(seqs: list[SeqAttention], groups: list[tuple[tuple[Run, ...], list[int]]],
                     max_keys: int = GATHER_KEYS) -> list[int]:
    """The sequences worth gathering: at most GATHER_QUERIES new tokens and `max_keys` keys, except a
    member of a shared-prefix group whose shared runs are half its keys or more (the cascade reads them
    once for all; gathered, each member would copy it), and except a lone sequence of one run
    (a view of the pool already: one kernel, no copy)."""
    cascade = {i for runs, members in groups for i in members
               if 2 * shared_keys(runs) >= seqs[i].q_pos0 + seqs[i].q_len}
    out = [i for i, seq in enumerate(seqs)
           if seq.q_len <= GATHER_QUERIES and seq.q_pos0 + seq.q_len <= max_keys and i not in cascade]
    if len(out) == 1 and len(seqs[out[0]].runs) == 1:
        return []
    return out


def plan_gathered(seqs: list[SeqAttention], members: list[int], groups: int, dtype: torch.dtype,
                  device) -> list[GatheredAttention]:
    """Buckets of `members` (from `gathered_members`): from the most keys down, a bucket holds the
    members that need at least 3/4 of its keys (rounded up to GATHER_ALIGN; a lone member's own keys),
    so no member reads more than a third more keys than it needs (the fused call's time grows with
    them), and at most GATHER_BUCKET_KEYS keys in all; queries pad to the bucket's longest. A member's
    keys are its runs in position order (positions 0 .. q_pos0 + q_len - 1)."""
    buckets: list[tuple[int, list[int]]] = []
    for i in sorted(members, key=lambda i: -(seqs[i].q_pos0 + seqs[i].q_len)):
        need = seqs[i].q_pos0 + seqs[i].q_len
        full = bool(buckets) and (len(buckets[-1][1]) + 1) * buckets[-1][0] > GATHER_BUCKET_KEYS
        if not buckets or full or 4 * need < 3 * buckets[-1][0]:
            buckets.append((-(-need // GATHER_ALIGN) * GATHER_ALIGN, []))
        buckets[-1][1].append(i)
    out = []
    for keys, idx in buckets:
        if len(idx) == 1:  # alone: its own keys exactly, so a decode step needs no mask at all
            keys = seqs[idx[0]].q_pos0 + seqs[idx[0]].q_len
        queries = max(seqs[i].q_len for i in idx)
        key_slots, q_rows, out_rows, out_sel, limits = [], [], [], [], []
        for b, i in enumerate(idx):
            seq = seqs[i]
            need = seq.q_pos0 + seq.q_len
            covered = 0
            for pos0, _, n in seq.runs:
                if pos0 != covered:
                    break
                covered += n
            if covered != need:
                raise ValueError(f"sequence {i}: runs {seq.runs} do not cover positions 0..{need - 1} in order")
            slots = [torch.arange(slot0, slot0 + n) for _, slot0, n in seq.runs]
            slots.append(torch.full((keys - need,), seq.runs[0][1]))
            key_slots.append(torch.cat(slots))
            rows = torch.arange(seq.q_start, seq.q_start + seq.q_len)
            q_rows += [rows, rows[-1:].expand(queries - seq.q_len)]
            out_rows.append(rows)
            out_sel.append(torch.arange(b * queries, b * queries + seq.q_len))
            # query t sees positions up to q_pos0 + t; a padding query repeats the last real one (finite, unread)
            limits.append(seq.q_pos0 + torch.arange(queries).clamp(max=seq.q_len - 1))
        limit = torch.stack(limits)  # [B, queries]
        keep = torch.arange(keys)[None, None, :] <= limit[:, :, None]  # [B, queries, keys]
        mask = None
        if not bool(keep.all()):
            # rows ordered (group, token), as the queries are laid out
            keep = keep[:, None, None].expand(-1, 1, groups, -1, -1).reshape(len(idx), 1, groups * queries, keys)
            mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, NEG_INF).to(device)
        out.append(GatheredAttention(idx, torch.cat(key_slots).to(device), torch.cat(q_rows).to(device),
                                     torch.cat(out_rows).to(device), torch.cat(out_sel).to(device), mask,
                                     queries, keys))
    return out


def attend_gathered(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, ga: GatheredAttention,
                    groups: int, scale: float) -> torch.Tensor:
    """Attention output [B * queries, Hkv * g, D] (padded rows included) of one bucket.

    q: [T, Hkv * g, D], every row of the batch; k_layer, v_layer: [Hkv, slots, D]."""
    hkv, _, d = k_layer.shape
    b = len(ga.members)
    # [B*queries, Hkv*g, D] -> [B, Hkv, g*queries, D]: rows ordered (group, token)
    qb = (q.index_select(0, ga.q_rows).view(b, ga.queries, hkv, groups, d).permute(0, 2, 3, 1, 4)
          .reshape(b, hkv, groups * ga.queries, d))
    k = k_layer.index_select(1, ga.key_slots).view(hkv, b, ga.keys, d).transpose(0, 1)
    v = v_layer.index_select(1, ga.key_slots).view(hkv, b, ga.keys, d).transpose(0, 1)
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=ga.mask, scale=scale)
    return out.view(b, hkv, groups, ga.queries, d).permute(0, 3, 1, 2, 4).reshape(b * ga.queries, hkv * groups, d)
