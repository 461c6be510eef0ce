"""Packed and padded model kwargs for the Gemma family (transformers 5.24).

Gemma's image tokens attend to each other bidirectionally (Gemma 3 in every layer, Gemma 4 in its sliding layers)
and most layers use a sliding window. Given ``token_type_ids`` and no prepared mask, transformers builds those masks
itself, right for one sequence and wrong for a packed row: ``create_causal_mask`` re-indexes Gemma's image-block
overlay by per-segment positions, so later samples' sliding layers lose their image blocks and see future image
tokens. So a packed batch never goes through it: the blocks come from the batch's token types per segment
(``batch_type_blocks``: each image's run of soft tokens its own block) and ``prepare_packed_inputs`` hands the model
one mask per layer type, ``window & (causal | block)`` on sliding layers, the window read from the text config. A
batch without the token types is refused on both paths (the model would silently attend causally inside images).
"""

from __future__ import annotations

from typing import Any

from mvp_engine.packing import (
    LAYER_TYPES,
    SDPA_VARLEN,
    batch_type_blocks,
    layer_masks,
    layer_predicates,
    prepare_packed_inputs,
    prepare_padded_inputs,
    text_positions,
    unwrap_model,
)

IMAGE_TYPE = 1  # the token type of image soft tokens (transformers' create_mm_token_type_ids)
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flex_attention")  # flash drops the bidirectional blocks


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str, *, media: dict[str, Any],
                   type_field: str, block_layer_types: tuple[str, ...] = LAYER_TYPES) -> dict[str, Any]:
    """Model kwargs of a packed Gemma batch: ids, (B, L) positions restarting per segment, ``media``, one mask
    per layer type with each image a bidirectional block on ``block_layer_types``, ``use_cache=False``."""
    blocks = batch_type_blocks(batch, type_field, kinds=(IMAGE_TYPE,))
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=text_positions(batch),
                                 position_rows=1, media=media, supported=ATTENTION_BACKENDS, block_ids=blocks,
                                 block_layer_types=block_layer_types)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str, *, media: dict[str, Any],
                   type_field: str, block_layer_types: tuple[str, ...] = LAYER_TYPES) -> dict[str, Any]:
    """Model kwargs of the unpacked baseline: the model builds its own masks from the token types, except on
    sdpa_varlen, for which transformers builds none: there each row gets the same predicates' per-span masks
    (equal to Gemma's own for one sequence: ``tests/test_masks.py``)."""
    blocks = batch_type_blocks(batch, type_field, kinds=(IMAGE_TYPE,))  # refuses a batch without them
    types = {type_field: batch[type_field]} if type_field in batch else {}  # absent only from all-padding rows
    kwargs = prepare_padded_inputs(batch, model, attn_implementation, media=media, **types)
    if attn_implementation == SDPA_VARLEN:
        model = unwrap_model(model)
        predicates = layer_predicates(model.config.get_text_config(), blocks, block_layer_types)
        kwargs["attention_mask"] = layer_masks(batch["pack_segment_ids"], predicates, SDPA_VARLEN, model.dtype)
    return kwargs
