"""Packed and padded model kwargs for Gemma 3: the family's (``recipes.gemma.packed``) with stacked
``pixel_values`` [N, C, H, W], whose soft tokens fill the placeholders in the order of the flattened batch, and
``token_type_ids`` as the token types. Gemma 3's images are bidirectional blocks in every layer type."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.packing import check_media_placement, unwrap_model
from mvp_engine.packing.batch_metadata import ConfigOf, media_checked, media_checked_metadata
from recipes import gemma

ATTENTION_BACKENDS = gemma.ATTENTION_BACKENDS
TYPE_FIELD = "token_type_ids"


def _media_kwargs(batch: dict[str, Any], model) -> dict[str, torch.Tensor]:
    """Stacked ``pixel_values``, after checking every segment holds exactly its own images' soft tokens (unless the
    collator did, :func:`packed_metadata`)."""
    config = unwrap_model(model).config
    pixel_values = batch.get("pixel_values")
    n_images = 0 if pixel_values is None else int(pixel_values.shape[0])
    if not media_checked(batch):
        check_media_placement(batch, batch["input_ids"] == config.image_token_id,
                              [config.mm_tokens_per_image] * n_images)
    return {} if n_images == 0 else {"pixel_values": pixel_values}


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's hook: the packed layout, and the media placement checked there, on the CPU, not in the step."""
    return partial(media_checked_metadata, check=_media_kwargs, model=ConfigOf(model))


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of a packed batch (no labels: the engine computes the loss)."""
    return gemma.prepare_packed(batch, model, attn_implementation, media=_media_kwargs(batch, model),
                                type_field=TYPE_FIELD)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of the unpacked baseline: one sample per row, a 2-D padding mask, the model's own masks from
    ``token_type_ids``, ``use_cache=False``."""
    return gemma.prepare_padded(batch, model, attn_implementation, media=_media_kwargs(batch, model),
                                type_field=TYPE_FIELD)
