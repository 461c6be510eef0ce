"""Packed and padded model kwargs for Gemma 4: the family's (``recipes.gemma.packed``) with pre-patchified
``pixel_values`` [N, max_patches, 3 p²] and their ``image_position_ids`` (merged per pack by the DataKit's media
handler, one row per image), ``mm_token_type_ids`` as the token types, and each image a bidirectional block in the
sliding layers only (``use_bidirectional_attention="vision"``: Gemma 4's full layers stay causal)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.packing import check_media_placement, unwrap_model
from mvp_engine.packing.batch_metadata import ConfigOf, media_checked, media_checked_metadata
from recipes import gemma

from .model import BLOCK_LAYER_TYPES, TYPE_FIELD

ATTENTION_BACKENDS = gemma.ATTENTION_BACKENDS


def _media_kwargs(batch: dict[str, Any], model) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_position_ids``, after checking every segment holds exactly its own images' soft
    tokens (an image's: its real patches / k²), unless the collator did (:func:`packed_metadata`)."""
    config = unwrap_model(model).config
    pixel_values = batch.get("pixel_values")
    checked = media_checked(batch)
    if pixel_values is None or not pixel_values.shape[0]:
        if not checked:
            check_media_placement(batch, batch["input_ids"] == config.image_token_id, [])
        return {}
    positions = batch.get("image_position_ids")
    if positions is None or positions.shape[:2] != pixel_values.shape[:2]:
        raise ValueError("Gemma 4 images need image_position_ids [N, max_patches, 2] beside pixel_values "
                         f"{tuple(pixel_values.shape)}, got {None if positions is None else tuple(positions.shape)}")
    if not checked:
        k = int(config.vision_config.pooling_kernel_size)
        tokens = ((positions != -1).all(-1).sum(-1) // (k * k)).tolist()
        check_media_placement(batch, batch["input_ids"] == config.image_token_id, tokens)
    return {"pixel_values": pixel_values, "image_position_ids": positions}


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's hook: the packed layout, and the media placement checked there, on the CPU, not in the step."""
    return partial(media_checked_metadata, check=_media_kwargs, model=ConfigOf(model))


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of a packed batch (no labels: the engine computes the loss)."""
    return gemma.prepare_packed(batch, model, attn_implementation, media=_media_kwargs(batch, model),
                                type_field=TYPE_FIELD, block_layer_types=BLOCK_LAYER_TYPES)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of the unpacked baseline: one sample per row, a 2-D padding mask, the model's own masks from
    ``mm_token_type_ids`` (on sdpa_varlen the family's per-span masks), ``use_cache=False``."""
    return gemma.prepare_padded(batch, model, attn_implementation, media=_media_kwargs(batch, model),
                                type_field=TYPE_FIELD, block_layer_types=BLOCK_LAYER_TYPES)
