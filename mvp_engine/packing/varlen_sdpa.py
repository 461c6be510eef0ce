"""``sdpa_varlen``: packed attention at the cost of the samples, not of the row, on any device torch sdpa runs on.

Why: eager/sdpa pack through a dense (B, 1, L, L) block-causal mask, so a packed row still pays L^2 attention
although only the sum of squared segment lengths is useful work; flash-attention's varlen kernels avoid that but
need CUDA. This backend takes the same kwargs as flash (``cu_seq_lens_q/k`` over the flattened B*L tokens, no
``attention_mask``) and runs causal torch sdpa on each span. It is registered with transformers'
``AttentionInterface`` (and flash's mask function, so no dense mask is ever built) when this package is imported;
``build_model(..., "sdpa_varlen")`` then selects it like any built-in backend. Measured in ``tools/bench_train.py``.
A mask more than causal (bidirectional blocks, a sliding window) comes as ``SpanMasks`` in ``attention_mask``, one
small mask per span (``mask_forms.span_masks``); spans without one keep the fused causal path. A preference pair's
segment (its ``cu_seq_lens`` told the pair's part lengths, ``branches.carry_pair_parts``) runs as its prefix, a
causal span like any other, and each continuation's attention over the prefix and over itself, two fused calls
merged by their log-sum-exp (``prefix_attention``): no mask, and no work on the block between the continuations.
torch sdpa cannot soft-cap scores: a layer asking for it is refused.

Without ``cu_seq_lens`` (the unpacked baseline) each row is one span, cut at the end of its 2-D padding mask
(right padding, as the collator produces).

Grouped-query models (fewer K/V heads than query heads) reach a fused kernel through :func:`gqa_arguments`: torch's
``enable_gqa`` only where the kernel that would take the call supports it, K/V expanded to the query's heads
elsewhere, so no span falls back to the math kernel and its n x n fp32 scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from .backends import SDPA_VARLEN
from .batch_metadata import host_bounds
from .branches import pair_parts
from .mask_forms import SpanMasks
from .prefix_attention import prefix_merged_attention


def _spans_from_padding_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> list[tuple[int, int]]:
    """One span per row over its real tokens (plus one for its padding run) of the flattened batch."""
    if attention_mask is None:
        return [(row * length, (row + 1) * length) for row in range(batch)]
    if attention_mask.dim() != 2:
        raise ValueError(f"{SDPA_VARLEN} takes cu_seq_lens_q/k or a 2-D padding mask, got a "
                         f"{attention_mask.dim()}-D attention_mask")
    real = attention_mask.bool()
    lengths = real.sum(-1).tolist()
    spans = []
    for row, n in enumerate(lengths):
        if not bool(real[row, :n].all()):
            raise ValueError(f"{SDPA_VARLEN} needs right padding (row {row} has padding before real tokens)")
        start = row * length
        spans += [(start, start + n)] if n == length else [(start, start + n), (start + n, start + length)]
    return [(a, b) for a, b in spans if b > a]


# what torch's CUDA flash kernel takes: its only fused kernel with GQA, as torch 2.13 documents enable_gqa
CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
CUDA_FLASH_MAX_HEAD_DIM = 256


def gqa_arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  device_type: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(key, value, enable_gqa)`` for ``F.scaled_dot_product_attention`` on (G, H, n, D) spans, chosen so that a
    grouped-query call reaches a fused kernel, not the math kernel that materialises n x n fp32 scores.

    On CUDA only the flash kernel takes ``enable_gqa``, and it refuses a mask, fp32 and head_dim > 256; a GQA call it
    refuses lands on the math kernel. So, with fewer K/V heads than query heads:

    - CUDA, no mask, fp16 / bf16, head_dim <= 256 (a plain causal span): K/V as they are, ``enable_gqa=True`` ->
      flash, no copy of K/V;
    - CUDA with a mask (a sliding-window or bidirectional-block span), fp32 (any span), or head_dim > 256: K/V
      expanded to the query's heads (``repeat_interleave``, the group's heads adjacent as ``enable_gqa`` pairs them),
      ``enable_gqa=False`` -> the memory-efficient kernel (masks, fp32 and head_dim 512 allowed), at the cost of a
      (G, H, n, D) copy of K and V per span instead of (G, H, n, n) scores;
    - any other device: K/V as they are, ``enable_gqa=True`` (torch 2.13's CPU flash kernel takes GQA with masks,
      fp32 and head_dim 512 alike; expanding would only copy).

    Equal head counts pass through unchanged with ``enable_gqa=False``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads == heads:
        return key, value, False
    flash_takes_it = (mask is None and query.dtype in CUDA_FLASH_DTYPES
                      and query.shape[-1] <= CUDA_FLASH_MAX_HEAD_DIM)
    if device_type != "cuda" or flash_takes_it:
        return key, value, True
    groups = heads // kv_heads
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), False


def _pair_layout(spans: list[tuple[int, int]], masks, parts, causal: bool, dropout: float, window) -> tuple:
    """The pieces the spans are computed in: ``(sizes, masks, prefix_of)``, a pair span split into its prefix (a
    causal span) and its continuations, ``prefix_of[i]`` the prefix piece whose keys continuation piece ``i`` also
    sees (module docstring). Without pair parts the spans as they are."""
    if parts is None:
        return [b - a for a, b in spans], masks, {}
    if len(parts) != len(spans):
        raise ValueError(f"{SDPA_VARLEN}: pair parts for {len(parts)} spans, cu_seq_lens hold {len(spans)}")
    if any(p is not None for p in parts) and (not causal or dropout or window is not None):
        raise ValueError(f"{SDPA_VARLEN} merges a shared prefix for causal attention without dropout or sliding "
                         f"window only (got is_causal={causal}, dropout={dropout}, sliding_window={window})")
    sizes, piece_masks, prefix_of = [], [], {}
    for (start, end), mask, lengths in zip(spans, masks, parts):
        if lengths is None:
            sizes.append(end - start)
            piece_masks.append(mask)
            continue
        if sum(lengths) != end - start:
            raise ValueError(f"{SDPA_VARLEN}: pair parts {lengths} do not fill the span {start}..{end}")
        if mask is not None:
            raise ValueError(f"{SDPA_VARLEN}: the pair span {start}..{end} has a mask of its own (bidirectional blocks "
                             "or a window beside a shared prefix are not merged)")
        prefix = len(sizes)
        sizes.append(lengths[0])
        piece_masks.append(None)
        for length in lengths[1:]:
            prefix_of[len(sizes)] = prefix
            sizes.append(length)
            piece_masks.append(None)
    return sizes, piece_masks, prefix_of


def sdpa_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """Causal sdpa inside each span of the flattened (B*L) tokens; returns (B, L, H, D) like transformers' kernels.
    ``attention_mask`` may be ``SpanMasks``: its spans, each with its own mask (None: plain causal). A pair
    segment's continuations see its prefix and themselves (module docstring)."""
    batch, heads, length, dim = query.shape
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{SDPA_VARLEN} cannot soft-cap attention scores (softcap={kwargs['softcap']}): torch sdpa "
                         "has no soft-capping; use eager or flex_attention")
    span_mask_list = None
    pairs = pair_parts(cu_seq_lens_q)
    if isinstance(attention_mask, SpanMasks):
        # compared by their values on the host (carried by the packed kwargs and the SpanMasks: no read-back)
        if cu_seq_lens_q is not None and host_bounds(cu_seq_lens_q) != host_bounds(attention_mask.cu_seq_lens):
            raise ValueError(f"{SDPA_VARLEN}: cu_seq_lens_q disagree with the SpanMasks' spans")
        cu_seq_lens_k = cu_seq_lens_q if cu_seq_lens_k is cu_seq_lens_q else cu_seq_lens_k
        cu_seq_lens_q, span_mask_list = attention_mask.cu_seq_lens, attention_mask.masks
    elif kwargs.get("sliding_window") is not None:
        raise ValueError(f"{SDPA_VARLEN} got sliding_window={kwargs['sliding_window']} but no SpanMasks: plain causal "
                         "spans would drop the window (pass span_masks(..., sliding_window(w) & ...))")
    if cu_seq_lens_q is None:
        spans = _spans_from_padding_mask(attention_mask, batch, length)
    else:
        # the packed kwargs hand one tensor for both (and its values on the host: no read-back per layer)
        if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and \
                host_bounds(cu_seq_lens_q) != host_bounds(cu_seq_lens_k):
            raise ValueError(f"{SDPA_VARLEN} is self-attention only: cu_seq_lens_q and cu_seq_lens_k differ")
        bounds = host_bounds(cu_seq_lens_q)
        if bounds[0] != 0 or bounds[-1] != batch * length:
            raise ValueError(f"{SDPA_VARLEN}: cu_seq_lens_q must cover all {batch * length} tokens, got {bounds[0]}.."
                             f"{bounds[-1]}")
        spans = list(zip(bounds[:-1], bounds[1:]))
    q, k, v = (t.transpose(0, 1).reshape(t.shape[1], batch * length, dim) for t in (query, key, value))
    causal = bool(module.is_causal if is_causal is None else is_causal)
    sizes, masks, prefix_of = _pair_layout(spans, span_mask_list or (None,) * len(spans), pairs, causal, dropout,
                                           kwargs.get("sliding_window"))
    # one split per tensor: slicing each span out separately makes every slice's backward fill a zero tensor of the
    # whole row (work ~ spans x L, i.e. L^2; 7.7 s of a 27.5 s step at 32 k, measured by tools/bench_long.py)
    pieces = [torch.split(t, sizes, dim=1) for t in (q, k, v)]
    groups: dict[object, list[int]] = {}
    for index, (n, mask) in enumerate(zip(sizes, masks)):
        if index not in prefix_of:  # a masked span runs alone
            groups.setdefault(n if mask is None else ("masked", index), []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(sizes)
    for indices in groups.values():
        # spans as 4-D (G, H, n, D): torch picks its fused kernels only for 4-D inputs (3-D falls back to the math
        # kernel: 7.5x slower and +3 GiB on one 8 k span, measured), and equal-length spans share one call
        qs, ks, vs = (torch.stack([parts[i] for i in indices]) for parts in pieces)
        mask = masks[indices[0]]
        ks, vs, gqa = gqa_arguments(qs, ks, vs, mask, qs.device.type)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
                                             scale=scaling, dropout_p=dropout, enable_gqa=gqa)
        for i, part in zip(indices, out.unbind(0)):
            outputs[i] = part
    for i, prefix in prefix_of.items():
        qp, kp, vp = (parts[i].unsqueeze(0) for parts in pieces)  # (1, H, n, D)
        kx, vx = (parts[prefix].unsqueeze(0) for parts in pieces[1:])
        outputs[i] = prefix_merged_attention(qp, kx, vx, kp, vp, scale=scaling)[0]
    out = torch.cat(outputs, dim=1)
    return out.reshape(heads, batch, length, dim).permute(1, 2, 0, 3).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="sdpa_varlen"`` known to transformers (idempotent)."""
    AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, flash_attention_mask)


register()
