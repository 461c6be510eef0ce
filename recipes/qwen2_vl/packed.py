"""Packed and padded model kwargs for Qwen2-VL (transformers 5.24).

How Qwen2-VL consumes positions (``modeling_qwen2_vl.py``):

- ``Qwen2VLModel.forward`` computes M-RoPE itself (``compute_3d_position_ids`` -> ``get_rope_index``) only when
  ``position_ids`` is None; ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, ...)`` walks each row as
  ONE sequence (text runs advance by 1, an image block takes a (t, h, w) grid starting at the current position,
  after it the position advances by ``max(h, w) / merge``) and consumes ``image_grid_thw`` in order across rows.
  Run on a packed row it would continue positions across samples: the per-segment positions are built here, each
  segment's call given that segment's own image grids and video grids (``video_grid_thw``, consumed in order too;
  a clip is one run of video tokens whose temporal positions advance by 1 per temporal patch in Qwen2-VL).
- ``Qwen2VLTextModel.forward``: (4, B, L) ``position_ids`` are split into a text row ``[0]`` and the M-RoPE rows
  ``[1:]``. Only the text row goes to ``create_causal_mask`` (packed detection) and to the attention function
  (flash's position-based varlen fallback); 2-D or (3, B, L) positions give ``text_position_ids=None``, i.e. no
  packed handling at all. The rotary embedding uses rows 1..3 only.

Attention choice for eager/sdpa: an explicit 4-D block-causal mask from ``pack_segment_ids`` (``create_causal_mask``
returns a 4-D mask untouched). Transformers' own detection from the text row gives the same logits (proved by
``test_transformers_packed_detection_is_equivalent`` in ``tests/test_packed_equivalence.py``), but it infers
boundaries from position steps and silently switches off when a cache or any 2-D mask is present; the explicit
mask follows the segment ids (the DataKit's truth) and costs the same (transformers materialises the same
(B, 1, L, L) mask when it detects packing).
Flash attention gets ``cu_seq_lens_q/k`` + ``max_length_q/k`` and no ``attention_mask``. flex_attention is not
offered: transformers 5.24 refuses it for Qwen2-VL at load time.

Everything not about M-RoPE or Qwen2-VL's media layout (backend check, masks per backend, guards, media order) is
the engine's: ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS, MediaKind
from mvp_engine.packing import (
    check_media_placement,
    prepare_packed_inputs,
    prepare_padded_inputs,
    row_segments,
    text_positions,
    unwrap_model,
)

# flex_attention is refused by transformers 5.24 for Qwen2-VL at load time.
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")
MEDIA = ((IMAGES, 1), (VIDEOS, 2))  # each media kind with its mm_token_type_ids code


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 text, 1 image placeholder, 2 video placeholder: the modality map ``get_rope_index`` walks."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def _base_model(model):
    """The ``Qwen2VLModel`` (owner of ``get_rope_index``) inside a ``Qwen2VLForConditionalGeneration``."""
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
                image_grid_thw=image_grids,
                video_grid_thw=video_grids,
            )
            positions[1:, row, start:end] = rope[:, 0].to(positions.dtype)
    return positions


def _media_kwargs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
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


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for a packed batch: ``input_ids``, media, (4, B, L) ``position_ids``, the backend's attention
    inputs, ``use_cache=False``. Labels are not included: the engine computes the loss from the logits."""
    return prepare_packed_inputs(batch, model, attn_implementation, position_ids=packed_position_ids(batch, model),
                                 position_rows=4, media=_media_kwargs(batch), supported=ATTENTION_BACKENDS)


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions computed by the
    model (``mm_token_type_ids`` passed so its M-RoPE sees the images and videos), ``use_cache=False``."""
    config = unwrap_model(model).config
    return prepare_padded_inputs(batch, model, attn_implementation, media=_media_kwargs(batch),
                                 mm_token_type_ids=mm_token_type_ids(batch["input_ids"], config))
