"""Generic, model-free helpers for running packed batches through transformers models."""

from .attention import (
    attention_mask_for,
    block_causal_mask,
    check_packed_model_kwargs,
    ensure_mask_fits,
    ensure_no_batch_fields,
    ensure_no_cache,
    ensure_position_rows,
    flash_varlen_kwargs,
    is_flash,
    row_segments,
    segment_positions,
    segment_run_ids,
    validate_segment_ids,
)

__all__ = [
    "attention_mask_for",
    "block_causal_mask",
    "check_packed_model_kwargs",
    "ensure_mask_fits",
    "ensure_no_batch_fields",
    "ensure_no_cache",
    "ensure_position_rows",
    "flash_varlen_kwargs",
    "is_flash",
    "row_segments",
    "segment_positions",
    "segment_run_ids",
    "validate_segment_ids",
]
