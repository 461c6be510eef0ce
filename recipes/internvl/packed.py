"""Packed and padded model kwargs for InternVL (transformers 5.24).

The Qwen2 / Qwen3 language model takes 1-D ``position_ids`` (B, L), restarting at every segment; the tiles of every
image of every sample are stacked ``pixel_values`` [tiles, C, H, W] in segment order, whose features fill the
``<IMG_CONTEXT>`` runs in the order of the flattened batch. ``image_num_patches`` (tiles per image) stays here: it
checks that every segment holds exactly its own images' tokens and is not a model input. Everything else (backend
check, the mask per backend, guards) is the engine's ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.packing import (
    check_media_placement,
    prepare_packed_inputs,
    prepare_padded_inputs,
    text_positions,
    unwrap_model,
)
from mvp_engine.packing.batch_metadata import ConfigOf, media_checked, media_checked_metadata

from .model import tokens_per_tile

ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flex_attention", "flash_attention_2")


def _media_kwargs(batch: dict[str, Any], model) -> dict[str, torch.Tensor]:
    """Stacked tiles ``pixel_values``, after checking every segment holds exactly its own images' context tokens
    (unless the collator did, :func:`packed_metadata`)."""
    config = unwrap_model(model).config
    pixel_values = batch.get("pixel_values")
    checked = media_checked(batch)
    if pixel_values is None or not pixel_values.shape[0]:
        if not checked:
            check_media_placement(batch, batch["input_ids"] == config.image_token_id, [])
        return {}
    if checked:
        return {"pixel_values": pixel_values}
    tiles = batch.get("image_num_patches")
    if tiles is None or int(tiles.sum()) != pixel_values.shape[0]:
        raise ValueError(f"a batch with {pixel_values.shape[0]} tiles needs image_num_patches (tiles per image) "
                         f"adding up to them, got {None if tiles is None else tiles.tolist()}")
    per_tile = tokens_per_tile(config)
    check_media_placement(batch, batch["input_ids"] == config.image_token_id, [int(n) * per_tile for n in tiles])
    return {"pixel_values": pixel_values}


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's hook: the packed layout, and the media placement checked there, on the CPU, not in the step."""
    return partial(media_checked_metadata, check=_media_kwargs, model=ConfigOf(model))


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for a packed batch: ``input_ids``, ``pixel_values``, (B, L) ``position_ids`` restarting per
    segment, the backend's attention inputs, ``use_cache=False``. No labels: the engine computes the loss."""
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=text_positions(batch),
                                 position_rows=1, media=_media_kwargs(batch, model), supported=ATTENTION_BACKENDS)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions left to the model,
    ``use_cache=False``."""
    return prepare_padded_inputs(batch, model, attn_implementation, media=_media_kwargs(batch, model))
