"""Packed and padded model kwargs the Qwen families share (Qwen2-VL, Qwen3-VL, Qwen3.5 in transformers 5.24): each
recipe binds ``prepare_packed`` to its own backends and documents how its model consumes the positions.

What is Qwen here: the modality map (``mm_token_type_ids``: 1 on ``config.image_token_id``, 2 on
``config.video_token_id``) and the media kinds (images, and clips with Qwen2.5-VL's per-clip seconds); their grid-patch
layout (one row per patch of the grids, one placeholder per ``spatial_merge_size**2`` cells) is the packing layer's
``grid_media``. The per-segment driving of the model's own ``get_rope_index`` into (4, B, L) positions is generic
(``mvp_engine.packing.segment_rope``); masks, guards and media order are ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES
from mvp_engine.packing import prepare_packed_inputs, prepare_padded_inputs, unwrap_model
from mvp_engine.packing.grid_media import grid_media_kwargs, grid_metadata
from mvp_engine.packing.segment_rope import (
    POSITION_ROWS,
    RopeIndex,
    precomputed_positions,
    segment_rope_positions,
    token_type_ids,
)

from .encoder import TIMED_VIDEOS

MEDIA = ((IMAGES, 1), (TIMED_VIDEOS, 2))  # each media kind with its mm_token_type_ids code
MEDIA_KINDS = tuple(kind for kind, _ in MEDIA)


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 text, 1 image placeholder, 2 video placeholder: the modality map ``get_rope_index`` walks."""
    return token_type_ids(input_ids, {config.image_token_id: 1, config.video_token_id: 2})


def rope_positions(batch: dict[str, Any], rope_index: RopeIndex) -> torch.Tensor:
    """(4, B, L) positions: row 0 the per-segment text positions, rows 1..3 the model's own ``get_rope_index`` run
    on each segment's slice with only that segment's image and video grids."""
    config = rope_index.config
    return segment_rope_positions(batch, rope_index, mm_token_type_ids(batch["input_ids"], config), MEDIA,
                                  config.vision_config.spatial_merge_size)


def packed_position_ids(batch: dict[str, Any], model) -> torch.Tensor:
    """The (4, B, L) positions of :func:`rope_positions`: those the collator computed (:func:`packed_metadata`),
    else computed now."""
    given = precomputed_positions(batch)
    return given if given is not None else rope_positions(batch, RopeIndex(model))


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's ``metadata`` hook for ``model``'s packed batches (picklable: the loader's workers run it):
    layout, media checked against their grids, M-RoPE positions (``grid_metadata``)."""
    return partial(grid_metadata, positions=partial(rope_positions, rope_index=RopeIndex(model)), kinds=MEDIA_KINDS)


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str, *,
                   supported: tuple[str, ...]) -> dict[str, Any]:
    """Model kwargs for a packed batch on one of the recipe's ``supported`` backends: ``input_ids``, media,
    (4, B, L) ``position_ids``, the backend's attention inputs (and a hybrid model's linear-attention boundaries),
    ``use_cache=False``. Labels are not included: the engine computes the loss from the logits."""
    media = grid_media_kwargs(batch, MEDIA_KINDS, checked=precomputed_positions(batch) is not None)
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=packed_position_ids(batch, model),
                                 position_rows=POSITION_ROWS, media=media, supported=supported)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions computed by the
    model (``mm_token_type_ids`` passed so its M-RoPE sees the images and videos), ``use_cache=False``."""
    config = unwrap_model(model).config
    return prepare_padded_inputs(batch, model, attn_implementation, media=grid_media_kwargs(batch, MEDIA_KINDS),
                                 mm_token_type_ids=mm_token_type_ids(batch["input_ids"], config))
