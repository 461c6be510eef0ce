"""One mask predicate (``masks.py``), every form a backend takes: a dense (B, 1, L, L) mask for eager / sdpa, a flex
``BlockMask`` built at block granularity (never an L x L tensor), and per-span masks for ``sdpa_varlen`` (each
sample's own n x n: memory Σ n² instead of L²). Every form confines the predicate to one run of ``pack_segment_ids``
(``same_segment``), so no predicate can let samples see each other; it must let every token see itself (all built
from ``causal()`` do), or a fully masked softmax row gives NaNs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch_metadata import carry_bounds
from .masks import Predicate, causal, same_segment
from .segments import flash_varlen_kwargs, validate_segment_ids

CAUSAL = causal()
FLEX_BLOCK_SIZE = 128  # the BlockMask's tile, flex's default


def flex_row_widths(max_len: int, cuda: bool, block_size: int = FLEX_BLOCK_SIZE) -> tuple[int, ...]:
    """The row widths a flex_attention batch pads to: on CUDA powers of two from one block up to ``max_len``
    rounded up to a whole block, and that rounded ``max_len`` (128, 256, ..., 4096, 5120 for 5000); elsewhere the
    rounded ``max_len`` alone.

    Why: flex_attention runs a kernel compiled for the batch's shapes (the BlockMask's follow the row width): the
    first width compiles a static kernel, the next one a dynamic kernel. With widths from a short list every batch
    of one width reuses one kernel, and every block is whole (full blocks skip the mask function); packs near
    ``max_len``, the common case, pad by less than a block, and only shorter rows pay up to 2x. torch 2.13's CPU
    flex template cannot compile the dynamic kernel (a C++ error), so off CUDA every batch takes the one width."""
    top = -(-max_len // block_size) * block_size
    widths = []
    width = block_size
    while cuda and width < top:
        widths.append(width)
        width *= 2
    return (*widths, top)


def packed_predicate(segment_ids: torch.Tensor, predicate: Predicate = CAUSAL) -> Predicate:
    """``same_segment(segment_ids) & predicate``: what every form evaluates."""
    validate_segment_ids(segment_ids)
    return same_segment(segment_ids) & predicate


def dense_mask(segment_ids: torch.Tensor, predicate: Predicate = CAUSAL,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, 1, L, L): bool (True = attend) for ``dtype=None``, the form transformers builds for sdpa; the additive form
    eager needs (0 where attended, ``finfo(dtype).min`` elsewhere) for a floating ``dtype``."""
    full = packed_predicate(segment_ids, predicate)
    batch, length = segment_ids.shape
    index = torch.arange(length, device=segment_ids.device)
    rows = torch.arange(batch, device=segment_ids.device)[:, None, None, None]
    allowed = full(rows, 0, index[None, None, :, None], index[None, None, None, :])
    if dtype is None:
        return allowed
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=segment_ids.device), torch.finfo(dtype).min)


def block_mask(segment_ids: torch.Tensor, predicate: Predicate = CAUSAL, block_size: int = FLEX_BLOCK_SIZE):
    """A flex ``BlockMask`` (B, 1, L, L) with :func:`dense_mask`'s pattern, from the predicate's ``tiles``: a block
    pair is skipped when no pair in it may attend, *full* (mask function skipped) when all do and both blocks are
    whole, *partial* otherwise. Uncompiled ``create_block_mask`` would evaluate the mask on every (q, k) pair
    (B x L x L; +10 GiB at L = 32 k); this costs (L / block_size)² per row."""
    from torch.nn.attention.flex_attention import BlockMask

    full = packed_predicate(segment_ids, predicate)
    batch, length = segment_ids.shape
    blocks = -(-length // block_size)
    starts = torch.arange(blocks, device=segment_ids.device) * block_size
    ends = (starts + block_size).clamp(max=length) - 1
    any_, all_ = (t.expand(batch, blocks, blocks) for t in full.tiles(starts, ends))
    whole = (ends - starts + 1) == block_size  # a block cut by the row's end is never full
    full_blocks = all_ & whole[None, :, None] & whole[None, None, :]
    partial = any_ & ~full_blocks

    def as_kv_blocks(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query block: how many key blocks are selected, and their indices first (stable order)."""
        counts = selected.sum(-1, dtype=torch.int32)
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    kv_num, kv_indices = as_kv_blocks(partial)
    full_num, full_indices = as_kv_blocks(full_blocks)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block_size,
                                    mask_mod=full, seq_lengths=(length, length))


@dataclass(frozen=True, eq=False)
class SpanMasks:
    """What ``sdpa_varlen`` takes as ``attention_mask`` when the predicate is more than causal: the runs over the
    flattened (B*L) tokens (``cu_seq_lens``, as flash's) and each run's own (n, n) bool mask, None where it is plain
    causal (that span keeps the fused ``is_causal`` path)."""

    cu_seq_lens: torch.Tensor
    masks: tuple[torch.Tensor | None, ...]


def span_masks(segment_ids: torch.Tensor, predicate: Predicate) -> SpanMasks:
    """Each run's mask, evaluated on the run's own positions (a run lies in one row)."""
    full = packed_predicate(segment_ids, predicate)
    length = segment_ids.shape[1]
    cu_seq_lens = flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"]
    bounds = cu_seq_lens.tolist()
    masks, more_than_causal = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        row, first = divmod(start, length)
        index = torch.arange(first, first + end - start, device=segment_ids.device)
        mask = full(torch.tensor(row, device=segment_ids.device), 0, index[:, None], index[None, :])
        masks.append(mask)
        more_than_causal.append(mask.triu(1).any() | (mask.sum() != len(index) * (len(index) + 1) // 2))
    # every span's verdict read back at once (one host sync, not two per span); its values carried for sdpa_varlen
    plain = (~torch.stack(more_than_causal)).tolist() if masks else []
    return SpanMasks(carry_bounds(cu_seq_lens, bounds),
                     tuple(None if is_plain else mask for mask, is_plain in zip(masks, plain)))
