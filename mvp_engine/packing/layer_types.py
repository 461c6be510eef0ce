"""Per-layer-type masks of hybrid models: sliding-window and full-attention layers, bidirectional blocks.

Models with ``config.layer_types`` (``full_attention`` / ``sliding_attention``) take a prepared dict of one mask per
layer type as ``attention_mask`` and then build none of their own. A plain 4-D mask there would reach every layer, so
the sliding layers would silently attend to the whole segment: :func:`layer_predicates` gives each type its
predicate, the window read from the config when the batch is prepared (as transformers reads it). Bidirectional
blocks (one image's soft tokens attending to each other) come from a per-token type field (``token_type_ids``,
``mm_token_type_ids``): :func:`type_blocks` makes each run of one non-text type inside one segment its own block.
Without that field such a model silently attends causally inside images, so :func:`batch_type_blocks` refuses a
batch that lacks it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from .masks import Predicate, causal, same_block, sliding_window

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


def type_blocks(type_ids: torch.Tensor, segment_ids: torch.Tensor,
                kinds: Collection[int] | None = None) -> torch.Tensor:
    """(B, L) block ids for :func:`~.masks.same_block`: every maximal run of one type in ``kinds`` (None: any
    non-zero type) inside one segment gets its own id, -1 elsewhere (text and padding)."""
    if type_ids.shape != segment_ids.shape:
        raise ValueError(f"token types {tuple(type_ids.shape)} and pack_segment_ids {tuple(segment_ids.shape)} differ")
    inside = (type_ids != 0 if kinds is None
              else torch.isin(type_ids, torch.tensor(list(kinds), device=type_ids.device)))
    start = inside.clone()
    new_run = (type_ids[:, 1:] != type_ids[:, :-1]) | (segment_ids[:, 1:] != segment_ids[:, :-1])
    start[:, 1:] &= new_run | ~inside[:, :-1]
    return torch.where(inside, start.long().cumsum(-1) - 1, -1)


def batch_type_blocks(batch: Mapping[str, Any], field: str, kinds: Collection[int] | None = None) -> torch.Tensor:
    """:func:`type_blocks` of ``batch[field]``; a batch without the field is refused (the model would silently
    attend causally inside every image), unless it is all padding: the all-padding row that keeps a short rank in
    step is an empty pack, which has no token fields, and no block to lose."""
    if batch.get(field) is None and not bool((batch["pack_segment_ids"] >= 0).any()):
        return torch.full_like(batch["pack_segment_ids"], -1)
    if batch.get(field) is None:
        raise ValueError(f"batch has no {field!r}: this model attends bidirectionally inside each image only when "
                         f"told which tokens are image tokens, and silently drops that without it (encode with an "
                         f"encoder whose token_type_field is {field!r})")
    return type_blocks(batch[field], batch["pack_segment_ids"], kinds)


def has_layer_types(config) -> bool:
    """Whether a (text) config has sliding-window layers, whose masks a single 4-D mask cannot express."""
    return SLIDING in (getattr(config, "layer_types", None) or ())


def layer_predicates(config, block_ids: torch.Tensor | None = None,
                     block_layer_types: Collection[str] = LAYER_TYPES) -> dict[str, Predicate]:
    """One predicate per layer type of ``config.layer_types`` (default all full): ``causal()``, or'd with
    ``same_block(block_ids)`` on ``block_layer_types``, and'd with ``sliding_window(config.sliding_window)`` on
    sliding layers — Gemma 3's ``window & (causal | block)`` for one sequence, which lets an image token see its
    block's later tokens but nothing further back than the window."""
    types = list(dict.fromkeys(getattr(config, "layer_types", None) or [FULL]))
    unknown = [t for t in types if t not in LAYER_TYPES]
    if unknown:
        raise ValueError(f"config.layer_types has {unknown}: packed masks exist for {list(LAYER_TYPES)} only")
    block = None if block_ids is None else same_block(block_ids)
    predicates = {}
    for layer_type in types:
        predicate = causal() if block is None or layer_type not in block_layer_types else causal() | block
        if layer_type == SLIDING:
            window = getattr(config, "sliding_window", None)
            if not isinstance(window, int) or window < 1:
                raise ValueError(f"config.sliding_window={window!r}: sliding_attention layers need an int >= 1")
            predicate = sliding_window(window) & predicate
        predicates[layer_type] = predicate
    return predicates
