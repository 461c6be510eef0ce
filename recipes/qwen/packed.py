"""Packed and padded model kwargs the Qwen families share (Qwen2-VL, Qwen3-VL, Qwen3.5 in transformers 5.24): each
recipe binds ``prepare_packed`` to its own backends and documents how its model consumes the positions.

What is Qwen here: the modality map (``mm_token_type_ids``: 1 on ``config.image_token_id``, 2 on
``config.video_token_id``), one placeholder per ``vision_config.spatial_merge_size**2`` grid cells, and the media
layout (``pixel_values`` / ``pixel_values_videos`` rows, one per patch of the ``image_grid_thw`` / ``video_grid_thw``
grids). The per-segment driving of the model's own ``get_rope_index`` into (4, B, L) positions is generic
(``mvp_engine.packing.segment_rope``); masks, guards and media order are ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES
from mvp_engine.packing import prepare_packed_inputs, prepare_padded_inputs, unwrap_model
from mvp_engine.packing.segment_rope import (
    POSITION_ROWS,
    RopeIndex,
    precomputed_positions,
    rope_metadata,
    segment_rope_positions,
    token_type_ids,
)

from .encoder import TIMED_VIDEOS

MEDIA = ((IMAGES, 1), (TIMED_VIDEOS, 2))  # each media kind with its mm_token_type_ids code


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


def collated_metadata(batch: dict[str, Any], positions: Callable[[dict[str, Any]], torch.Tensor]) -> dict[str, Any]:
    """A packed batch's metadata, on the CPU where it is collated: its layout, its media checked against their
    grids and its M-RoPE ``positions`` (``rope_metadata``)."""
    media_kwargs(batch)
    return rope_metadata(batch, positions)


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's ``metadata`` hook for ``model``'s packed batches (picklable: the loader's workers run it)."""
    return partial(collated_metadata, positions=partial(rope_positions, rope_index=RopeIndex(model)))


def media_kwargs(batch: dict[str, Any], checked: bool = False) -> dict[str, torch.Tensor]:
    """Pixels and grids of the batch's images and videos, each checked to hold the patches its grids need (unless
    the collator ``checked`` them), and the per-item fields the batch carries (Qwen2.5-VL's
    ``second_per_grid_ts``, which its own M-RoPE reads)."""
    kwargs = {}
    for kind, _ in MEDIA:
        grids = batch.get(kind.grid_key)
        if grids is None or grids.shape[0] == 0:
            continue
        pixels = batch[kind.patch_key]
        if not checked and pixels.shape[0] != (needed := int(grids.prod(-1).sum())):
            raise ValueError(f"{kind.patch_key} has {pixels.shape[0]} patches, {kind.grid_key} needs {needed}")
        kwargs.update({kind.patch_key: pixels, kind.grid_key: grids})
        kwargs.update({key: batch[key] for key in kind.item_keys if batch.get(key) is not None})
    return kwargs


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str, *,
                   supported: tuple[str, ...]) -> dict[str, Any]:
    """Model kwargs for a packed batch on one of the recipe's ``supported`` backends: ``input_ids``, media,
    (4, B, L) ``position_ids``, the backend's attention inputs (and a hybrid model's linear-attention boundaries),
    ``use_cache=False``. Labels are not included: the engine computes the loss from the logits."""
    media = media_kwargs(batch, checked=precomputed_positions(batch) is not None)
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=packed_position_ids(batch, model),
                                 position_rows=POSITION_ROWS, media=media, supported=supported)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions computed by the
    model (``mm_token_type_ids`` passed so its M-RoPE sees the images and videos), ``use_cache=False``."""
    config = unwrap_model(model).config
    return prepare_padded_inputs(batch, model, attn_implementation, media=media_kwargs(batch),
                                 mm_token_type_ids=mm_token_type_ids(batch["input_ids"], config))
