"""Packed and padded model kwargs for Qwen2-VL (transformers 5.24).

How Qwen2-VL consumes positions (``modeling_qwen2_vl.py``):

- ``Qwen2VLModel.forward`` computes M-RoPE itself (``compute_3d_position_ids`` -> ``get_rope_index``) only when
  ``position_ids`` is None; ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, ...)`` walks each row as
  ONE sequence (text runs advance by 1, an image block takes a (t, h, w) grid starting at the current position,
  after it the position advances by ``max(h, w) / merge``) and consumes ``image_grid_thw`` in order across rows.
  Run on a packed row it would continue positions across samples: the per-segment positions are built here.
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
"""

from __future__ import annotations

from typing import Any

import torch

from mvp_engine.packing import (
    attention_mask_for,
    check_packed_model_kwargs,
    flash_varlen_kwargs,
    is_flash,
    row_segments,
    segment_positions,
    validate_segment_ids,
)


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 text, 1 image placeholder, 2 video placeholder: the modality map ``get_rope_index`` walks."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def _base_model(model):
    """The ``Qwen2VLModel`` (owner of ``get_rope_index``) inside a ``Qwen2VLForConditionalGeneration``."""
    return model.model if hasattr(model, "lm_head") else model


def _unwrap(model):
    """The transformers model inside a DDP / accelerate wrapper (which hide ``config`` and ``dtype``)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def _check_backend(model, attn_implementation: str) -> None:
    configured = model.config._attn_implementation
    if configured != attn_implementation:
        raise ValueError(
            f"model runs attn_implementation={configured!r} but the batch is prepared for {attn_implementation!r}: "
            "the mask format would not match (eager adds the mask, sdpa reads bool, flash needs cu_seq_lens)"
        )


def packed_position_ids(batch: dict[str, Any], model) -> torch.Tensor:
    """(4, B, L) positions: row 0 the per-segment text positions, rows 1..3 the model's own ``get_rope_index`` run
    on each segment's slice with only that segment's image grids; padding gets one fresh run in all 4 rows."""
    model = _unwrap(model)
    input_ids, segment_ids = batch["input_ids"], batch["pack_segment_ids"]
    validate_segment_ids(segment_ids)
    config = model.config
    text = segment_positions(segment_ids)
    if "position_ids" in batch and not torch.equal(batch["position_ids"].to(text.device), text):
        raise ValueError("batch position_ids disagree with pack_segment_ids (expected a restart at every segment)")
    positions = text.unsqueeze(0).repeat(4, 1, 1)
    types = mm_token_type_ids(input_ids, config)
    if bool((types == 2).any()) or batch.get("video_grid_thw") is not None:
        raise NotImplementedError("packed video is not supported by this recipe yet")

    grids = batch.get("image_grid_thw")
    n_images = 0 if grids is None else int(grids.shape[0])
    merge = config.vision_config.spatial_merge_size
    owners = _image_owners(batch, n_images)
    get_rope_index = _base_model(model).get_rope_index
    cursor = 0
    for row, runs in enumerate(row_segments(segment_ids)):
        for seg, start, end in runs:
            if seg < 0:
                continue
            first = cursor
            while cursor < n_images and owners[cursor] == (row, seg):
                cursor += 1
            seg_types = types[row, start:end]
            seg_grids = grids[first:cursor] if cursor > first else None
            needed = 0 if seg_grids is None else int((seg_grids.prod(-1) // merge**2).sum())
            have = int((seg_types == 1).sum())
            if have != needed:
                raise ValueError(
                    f"row {row} segment {seg}: {have} image tokens but its {cursor - first} image(s) need {needed}"
                )
            if seg_grids is None:
                continue  # text-only: get_rope_index gives the same arange as row 0
            rope, _ = get_rope_index(
                input_ids[row : row + 1, start:end],
                mm_token_type_ids=seg_types.unsqueeze(0),
                image_grid_thw=seg_grids,
            )
            positions[1:, row, start:end] = rope[:, 0].to(positions.dtype)
    if cursor != n_images:
        raise ValueError(f"{n_images - cursor} image(s) belong to no segment of the batch (media order is row-major)")
    return positions


def _image_owners(batch: dict[str, Any], n_images: int) -> list[tuple[int, int]]:
    """``(row, segment)`` of every image, required to be in row-major, segment order."""
    if n_images == 0:
        return []
    rows, segs = batch.get("media_batch_index"), batch.get("media_segment_ids")
    if rows is None or segs is None:
        raise ValueError("a batch with images needs media_batch_index and media_segment_ids")
    owners = list(zip(rows.tolist(), segs.tolist()))
    if len(owners) != n_images:
        raise ValueError(f"{len(owners)} media owners for {n_images} images")
    if owners != sorted(owners):
        raise ValueError("media must be concatenated in row-major, segment order (the model fills placeholders so)")
    return owners


def _media_kwargs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    grids = batch.get("image_grid_thw")
    if grids is None or grids.shape[0] == 0:
        return {}
    pixel_values = batch["pixel_values"]
    if pixel_values.shape[0] != int(grids.prod(-1).sum()):
        needed = int(grids.prod(-1).sum())
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw needs {needed}")
    return {"pixel_values": pixel_values, "image_grid_thw": grids}


def prepare_packed(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for a packed batch: ``input_ids``, media, (4, B, L) ``position_ids``, the backend's attention
    inputs, ``use_cache=False``. Labels are not included: the engine computes the loss from the logits."""
    model = _unwrap(model)
    _check_backend(model, attn_implementation)
    segment_ids = batch["pack_segment_ids"]
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": packed_position_ids(batch, model),
        "use_cache": False,
        **_media_kwargs(batch),
    }
    if is_flash(attn_implementation):
        varlen = flash_varlen_kwargs(segment_ids)
        if "cu_seqlens" in batch and not torch.equal(batch["cu_seqlens"].to(torch.int32).cpu(),
                                                     varlen["cu_seq_lens_q"].cpu()):
            raise ValueError("batch cu_seqlens disagree with pack_segment_ids")
        kwargs.update(varlen)
    elif attn_implementation in ("eager", "sdpa"):
        kwargs["attention_mask"] = attention_mask_for(segment_ids, attn_implementation, model.dtype)
    else:
        raise NotImplementedError(f"packed attention for {attn_implementation!r} is not implemented in qwen2_vl")
    check_packed_model_kwargs(kwargs, attn_implementation, position_rows=4)
    return kwargs


def prepare_padded(batch: dict[str, Any], model, attn_implementation: str) -> dict[str, Any]:
    """Model kwargs for the unpacked baseline: one sample per row, a 2-D padding mask, positions computed by the
    model (``mm_token_type_ids`` passed so its M-RoPE sees the images), ``use_cache=False``."""
    model = _unwrap(model)
    _check_backend(model, attn_implementation)
    segment_ids = batch["pack_segment_ids"]
    validate_segment_ids(segment_ids)
    if bool((segment_ids > 0).any()):
        rows = sorted(set((segment_ids > 0).nonzero()[:, 0].tolist()))
        raise ValueError(f"prepare_padded got packed rows {rows} (more than one segment); use prepare_packed")
    input_ids = batch["input_ids"]
    return {
        "input_ids": input_ids,
        "attention_mask": (segment_ids >= 0).long(),
        "mm_token_type_ids": mm_token_type_ids(input_ids, model.config),
        "use_cache": False,
        **_media_kwargs(batch),
    }
