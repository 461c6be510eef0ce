"""Packed and padded model kwargs for GLM-4.1V (transformers 5.24, ``modeling_glm4v.py``).

How GLM-4.1V consumes positions and media:

- ``Glm4vModel.forward`` computes its 3-D rope (``compute_3d_position_ids`` -> ``get_rope_index``) only when
  ``position_ids`` is None, and then requires ``mm_token_type_ids`` (1 image, 2 video). ``get_rope_index`` splits
  each clip's grid ``(t, h, w)`` into ``t`` grids ``(1, h, w)`` (one run of placeholders per temporal patch, the
  whole-second timestamp between runs is text), walks the row as ONE sequence: text advances by 1, a run starting at
  ``p`` gets temporal ``p`` (every frame: GLM-4.1V's rope carries time only through the timestamps), height
  ``p + i``, width ``p + j``, and moves ``p`` on by ``max(h, w) / merge``. Grids are consumed in order across
  rows, so ``mvp_engine.packing.segment_rope`` calls it per segment with that segment's own grids, the types read
  from the batch's ``mm_token_type_ids`` (the DataKit carries them: frames reuse the image placeholder, so types
  cannot be recovered from the ids alone).
- ``Glm4vTextModel.forward``: (4, B, L) positions split into a text row (``create_causal_mask`` and the attention
  function) and the rotary rows; 2-D or (3, B, L) positions give no packed handling at all.
- Placeholders: the model's ``input_ids`` carry ``config.video_token_id`` on video placeholders
  (:func:`model_input_ids`, read by ``model.Glm4vMixedMediaModel``), so a pack of images and clips scatters each
  feature onto its own token; features are scattered in flattened row-major order, which is the DataKit's media
  order (``check_media_placement`` checks every segment's counts against its own grids).
- The vision tower derives its own ``cu_seqlens`` from the grids (a frame attends within itself); the language
  model's varlen kwargs never reach it.

Attention: eager/sdpa get an explicit 4-D block-causal mask; flash_attention_2 and sdpa_varlen get ``cu_seq_lens_q/k``
+ ``max_length_q/k`` and no ``attention_mask``. flex_attention is not offered: GLM-4.1V does not declare it in 5.24.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES
from mvp_engine.packing import prepare_packed_inputs, prepare_padded_inputs, unwrap_model
from mvp_engine.packing.grid_media import grid_media_kwargs, grid_metadata
from mvp_engine.packing.segment_rope import POSITION_ROWS, RopeIndex, precomputed_positions, segment_rope_positions

from .encoder import TOWER_VIDEOS, TYPE_FIELD

ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")
MEDIA = ((IMAGES, 1), (TOWER_VIDEOS, 2))  # each media kind with its mm_token_type_ids code
MEDIA_KINDS = (IMAGES, TOWER_VIDEOS)


def token_types(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's ``mm_token_type_ids``; without them a video's frames would pass for images. An all-padding batch
    (the empty pack that keeps a short rank in step has no token fields) is all text."""
    types = batch.get(TYPE_FIELD)
    if types is None and not bool((batch["pack_segment_ids"] >= 0).any()):
        return torch.zeros_like(batch["input_ids"])
    if types is None:
        raise ValueError(f"GLM-4.1V batch has no {TYPE_FIELD!r}: its video frames reuse the image placeholder, so "
                         "only the encoder's token types tell them apart (encode with Glm4vSampleEncoder)")
    return types


def model_input_ids(batch: dict[str, Any], config) -> torch.Tensor:
    """``input_ids`` with ``config.video_token_id`` on every video placeholder (type 2)."""
    return torch.where(token_types(batch) == 2, config.video_token_id, batch["input_ids"])


def rope_positions(batch: dict[str, Any], rope_index: RopeIndex) -> torch.Tensor:
    """(4, B, L) positions: the per-segment text row, then the model's ``get_rope_index`` per segment."""
    return segment_rope_positions(batch, rope_index, token_types(batch).int(), MEDIA,
                                  rope_index.config.vision_config.spatial_merge_size)


def packed_position_ids(batch: dict[str, Any], model) -> torch.Tensor:
    """The positions of :func:`rope_positions`: those the collator computed (:func:`packed_metadata`), else computed
    now."""
    given = precomputed_positions(batch)
    return given if given is not None else rope_positions(batch, RopeIndex(model))


def packed_metadata(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The collator's ``metadata`` hook for ``model``'s packed batches: layout, media checked against their grids,
    GLM-4.1V's positions (``grid_metadata``)."""
    return partial(grid_metadata, positions=partial(rope_positions, rope_index=RopeIndex(model)), kinds=MEDIA_KINDS)


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of a packed batch (no labels: the engine computes the loss from the logits)."""
    config = unwrap_model(model).config
    inputs = {**batch, "input_ids": model_input_ids(batch, config)}
    media = grid_media_kwargs(batch, MEDIA_KINDS, checked=precomputed_positions(batch) is not None)
    return prepare_packed_inputs(inputs, model, attn_implementation, position_ids=packed_position_ids(batch, model),
                                 position_rows=POSITION_ROWS, media=media, supported=ATTENTION_BACKENDS)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs of the unpacked baseline: one sample per row, a 2-D padding mask, the model's own 3-D rope from
    ``mm_token_type_ids``, ``use_cache=False``."""
    config = unwrap_model(model).config
    inputs = {**batch, "input_ids": model_input_ids(batch, config)}
    return prepare_padded_inputs(inputs, model, attn_implementation, media=grid_media_kwargs(batch, MEDIA_KINDS),
                                 mm_token_type_ids=token_types(batch).int())
