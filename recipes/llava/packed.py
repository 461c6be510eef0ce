"""Packed and padded model kwargs for LLaVA (transformers 5.24).

LLaVA is the plain case: the Llama language model takes 1-D ``position_ids`` (B, L), restarting at every segment,
and the images are stacked ``pixel_values`` [N, C, H, W] whose features fill the ``<image>`` placeholders in the
order of the flattened batch. Everything else (backend check, the mask per backend: a 4-D block-causal mask for
eager/sdpa, a ``BlockMask`` for flex_attention, ``cu_seq_lens_q/k`` for flash and sdpa_varlen; guards) is the engine's
``mvp_engine.packing.inputs``. ``create_causal_mask`` passes a ready 4-D mask or ``BlockMask`` through unchanged.

The flash path relies on the vision tower not running flash (``mvp_engine.packing.sub_model_attention``): LLaVA gives
the vision tower every extra kwarg, so the language model's ``cu_seq_lens_q/k`` reach it too; a guard refuses a
model whose vision tower runs flash.
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
    takes_varlen_kwargs,
    text_positions,
    unwrap_model,
)
from mvp_engine.packing.batch_metadata import ConfigOf, media_checked, media_checked_metadata

from .model import image_token_count

ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flex_attention", "flash_attention_2")


def _media_kwargs(batch: dict[str, Any], model) -> dict[str, torch.Tensor]:
    """Stacked ``pixel_values``, after checking every segment holds exactly its own images' placeholders (unless
    the collator did, :func:`packed_metadata`)."""
    config = unwrap_model(model).config
    pixel_values = batch.get("pixel_values")
    n_images = 0 if pixel_values is None else int(pixel_values.shape[0])
    if not media_checked(batch):
        placeholder = batch["input_ids"] == config.image_token_id
        check_media_placement(batch, placeholder, [image_token_count(config)] * n_images)
    return {} if n_images == 0 else {"pixel_values": pixel_values}


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's hook: the packed layout, and the media placement checked there, on the CPU, not in the step."""
    return partial(media_checked_metadata, check=_media_kwargs, model=ConfigOf(model))


def _check_vision_backend(model, attn_implementation: str) -> None:
    vision = unwrap_model(model).config.vision_config._attn_implementation
    if takes_varlen_kwargs(attn_implementation) and takes_varlen_kwargs(vision):
        raise ValueError(f"the vision tower runs {vision!r}: LLaVA hands it the language model's cu_seq_lens, which "
                         "it would take as its own; build the model with recipes.llava.model.build_model")


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for a packed batch: ``input_ids``, ``pixel_values``, (B, L) ``position_ids`` restarting per
    segment, the backend's attention inputs, ``use_cache=False``. No labels: the engine computes the loss."""
    _check_vision_backend(model, attn_implementation)
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=text_positions(batch),
                                 position_rows=1, media=_media_kwargs(batch, model), supported=ATTENTION_BACKENDS)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions left to the model,
    ``use_cache=False``."""
    return prepare_padded_inputs(batch, model, attn_implementation, media=_media_kwargs(batch, model))
