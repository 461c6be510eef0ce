"""Packed and padded inputs for the Qwen vision-language families' multimodal RoPE (M-RoPE).

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 share one contract in transformers 5.24: the base model's
``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw)`` walks each row as ONE sequence,
runs of placeholder tokens (``mm_token_type_ids`` 1 image, 2 video) consuming grids in order across rows. Run on a
packed row it would continue positions across samples, so each segment's slice gets its own call with only that
segment's grids. The family differences stay inside the model's ``get_rope_index``: Qwen2-VL advances time by 1
per temporal patch; Qwen3-VL / Qwen3.5 split a clip's grid into one frame per run (timestamps are text between
frames) and interleave the rotary sections. Either way the per-segment call is what one-by-one would compute.

The positions are (4, B, L): row 0 the per-segment text positions (what ``create_causal_mask`` and flash's
position-based varlen fallback read), rows 1..3 the M-RoPE rows. Everything not about M-RoPE or the Qwen media
layout (backend check, masks, guards, media order) is ``inputs``.
"""

from __future__ import annotations

from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS, MediaKind

from .attention import row_segments
from .inputs import check_media_placement, prepare_packed_inputs, prepare_padded_inputs, text_positions, unwrap_model

MEDIA = ((IMAGES, 1), (VIDEOS, 2))  # each media kind with its mm_token_type_ids code


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 text, 1 image placeholder, 2 video placeholder: the modality map ``get_rope_index`` walks."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def _base_model(model):
    """The base model (owner of ``get_rope_index``) inside a ``...ForConditionalGeneration``."""
    return model.model if hasattr(model, "lm_head") else model


def _segment_grids(batch: dict[str, Any], types: torch.Tensor, kind: MediaKind, code: int,
                   merge: int) -> dict[tuple[int, int], torch.Tensor]:
    """``(row, segment)`` -> that segment's grids of ``kind``, each segment's placeholders checked against them."""
    grids = batch.get(kind.grid_key)
    tokens = [] if grids is None else (grids.prod(-1) // merge**2).tolist()
    owners = check_media_placement(batch, types == code, tokens, kind)
    items: dict[tuple[int, int], list[int]] = {}
    for index, owner in enumerate(owners):
        items.setdefault(owner, []).append(index)
    return {owner: grids[indices] for owner, indices in items.items()}


def packed_position_ids(batch: dict[str, Any], model) -> torch.Tensor:
    """(4, B, L) positions: row 0 the per-segment text positions, rows 1..3 the model's own ``get_rope_index`` run
    on each segment's slice with only that segment's image and video grids; padding gets one fresh run in all 4
    rows."""
    model = unwrap_model(model)
    input_ids, segment_ids = batch["input_ids"], batch["pack_segment_ids"]
    config = model.config
    text = text_positions(batch)
    positions = text.unsqueeze(0).repeat(4, 1, 1)
    types = mm_token_type_ids(input_ids, config)
    merge = config.vision_config.spatial_merge_size
    grids = {kind: _segment_grids(batch, types, kind, code, merge) for kind, code in MEDIA}
    get_rope_index = _base_model(model).get_rope_index
    for row, runs in enumerate(row_segments(segment_ids)):
        for seg, start, end in runs:
            image_grids, video_grids = (grids[kind].get((row, seg)) for kind, _ in MEDIA)
            if image_grids is None and video_grids is None:
                continue  # padding, or text-only: get_rope_index gives the same arange as row 0
            rope, _ = get_rope_index(
                input_ids[row : row + 1, start:end],
                mm_token_type_ids=types[row, start:end].unsqueeze(0),
                image_grid_thw=None if image_grids is None else image_grids.clone(),
                video_grid_thw=None if video_grids is None else video_grids.clone(),  # Qwen3-VL edits it in place
            )
            positions[1:, row, start:end] = rope[:, 0].to(positions.dtype)
    return positions


def media_kwargs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Pixels and grids of the batch's images and videos, each checked to hold the patches its grids need."""
    kwargs = {}
    for kind, _ in MEDIA:
        grids = batch.get(kind.grid_key)
        if grids is None or grids.shape[0] == 0:
            continue
        pixels, needed = batch[kind.patch_key], int(grids.prod(-1).sum())
        if pixels.shape[0] != needed:
            raise ValueError(f"{kind.patch_key} has {pixels.shape[0]} patches, {kind.grid_key} needs {needed}")
        kwargs.update({kind.patch_key: pixels, kind.grid_key: grids})
    return kwargs


def prepare_mrope_packed(batch: dict[str, Any], model, attn_implementation: str,
                         supported: tuple[str, ...]) -> dict[str, Any]:
    """Model kwargs for a packed batch: ``input_ids``, media, (4, B, L) ``position_ids``, the backend's attention
    inputs, ``use_cache=False``. Labels are not included: the engine computes the loss from the logits."""
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=packed_position_ids(batch, model),
                                 position_rows=4, media=media_kwargs(batch), supported=supported)


def prepare_mrope_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions computed by the
    model (``mm_token_type_ids`` passed so its M-RoPE sees the images and videos), ``use_cache=False``."""
    config = unwrap_model(model).config
    return prepare_padded_inputs(batch, model, attn_implementation, media=media_kwargs(batch),
                                 mm_token_type_ids=mm_token_type_ids(batch["input_ids"], config))
