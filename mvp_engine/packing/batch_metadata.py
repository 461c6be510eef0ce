"""Packed metadata computed once per batch on the CPU, where the batch is collated (the run's DataLoader workers),
and carried to the step, so the step reads no value back from the device to build its model kwargs.

Why: every quantity a packed forward needs besides the tokens (per-segment positions, M-RoPE included, the
flattened ``cu_seqlens`` and their longest run, each row's segment spans) is a function of ``pack_segment_ids`` and
the media grids, which the collator holds on the CPU. Computed in the step from device tensors, each ``.tolist()``,
``int(...)`` or ``nonzero`` per segment, per media item and per attention layer made the host wait for the GPU's
queue to drain (``tests/test_host_syncs.py`` counts them); computed here they cost nothing on the device and run
beside the GPU's work in the loader's workers.

:func:`describe_packed` is the one place that reads a packed batch's layout and checks it (the checks the step ran
before: segment ids, positions and ``cu_seqlens`` agree); a family adds its own positions (``segment_rope`` for
M-RoPE). The step uses what the batch carries (:func:`batch_metadata`) and computes the same itself where a batch
was collated without it (a tool's own collator), so the metadata is an optimisation, never a second truth.
``cu_seqlens`` reach attention kernels with their values known on the host (:func:`carry_bounds`): ``sdpa_varlen``
and the linear-attention layers split their spans by them without reading the device tensor back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mvp_engine.kit.mllm.data.collator import PACKED_METADATA, PACKED_POSITIONS

from .segments import flash_varlen_kwargs, row_segments
from .unwrap import unwrap_model

METADATA = PACKED_METADATA  # the batch field holding a PackedMetadata (collator -> step)
__all__ = ["METADATA", "PACKED_POSITIONS", "ConfigOf", "PackedMetadata", "batch_metadata", "carry_bounds",
           "describe_packed", "describe_varlen", "host_bounds", "media_checked", "media_checked_metadata",
           "packed_varlen_kwargs"]
_HOST_BOUNDS = "_host_bounds"  # a cu_seqlens tensor's values as Python ints, set by carry_bounds


@dataclass(frozen=True)
class PackedMetadata:
    """What a packed batch's layout is, read on the CPU: each row's ``(segment_id, start, end)`` runs (padding
    included, id -1), the flattened ``cu_seqlens`` over all rows as Python ints (the batch's own ``cu_seqlens``
    tensor holds the same values) and the longest run."""

    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    bounds: tuple[int, ...]
    max_length: int
    media_checked: bool = False  # the recipe's media placement checks ran in the collator (media_checked_metadata)


def describe_packed(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``{METADATA: PackedMetadata}`` of a collated packed batch (CPU tensors), its layout checked: segment ids,
    the batch's ``position_ids`` (``inputs.text_positions``) and ``cu_seqlens`` agree with each other. The collator's
    ``metadata`` hook for a model that takes the text positions; a multimodal-RoPE family adds its positions to it
    (``segment_rope.rope_metadata``)."""
    from .inputs import text_positions  # the one definition of a packed batch's positions (inputs imports this module)

    text_positions({key: value for key, value in batch.items() if key != METADATA})
    varlen = describe_varlen(batch)
    runs = tuple(tuple(row) for row in row_segments(batch["pack_segment_ids"]))
    return {METADATA: PackedMetadata(runs, tuple(varlen["cu_seq_lens_q"].tolist()), varlen["max_length_q"])}


class ConfigOf:
    """What a recipe's media checks read of a model, its config, without the model (picklable, no weights): the
    ``model`` they are handed in the collator."""

    def __init__(self, model):
        self.config = unwrap_model(model).config


def media_checked_metadata(batch: Mapping[str, Any], check: Callable[[Mapping[str, Any], Any], Any],
                           model: ConfigOf) -> dict[str, Any]:
    """:func:`describe_packed`'s metadata with the recipe's media placement ``check(batch, model)`` run here, on the
    CPU (every segment's placeholders against its own media: ``.tolist()`` and ``nonzero`` of the whole batch), so the
    step skips it (:func:`media_checked`). A family whose checks read only the model's config uses it as its
    ``packed_metadata`` hook."""
    check(batch, model)
    return {METADATA: replace(describe_packed(batch)[METADATA], media_checked=True)}


def media_checked(batch: Mapping[str, Any]) -> bool:
    """True when the collator checked ``batch``'s media placement already (:func:`media_checked_metadata`)."""
    metadata = batch_metadata(batch)
    return metadata is not None and metadata.media_checked


def batch_metadata(batch: Mapping[str, Any]) -> PackedMetadata | None:
    """The metadata the collator computed for ``batch`` (None: it was collated without)."""
    return batch.get(METADATA)


def carry_bounds(cu_seqlens: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """``cu_seqlens`` (any device) told its own values, so kernels that split by them read no device value back."""
    setattr(cu_seqlens, _HOST_BOUNDS, tuple(bounds))
    return cu_seqlens


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """The values of ``cu_seqlens``: those :func:`carry_bounds` gave it, else read from the tensor (a sync on a
    GPU)."""
    known = getattr(cu_seqlens, _HOST_BOUNDS, None)
    return list(known) if known is not None else [int(b) for b in cu_seqlens.tolist()]


def packed_varlen_kwargs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` of a packed batch: from its metadata and its own ``cu_seqlens``
    (already on the step's device, values carried) where the collator computed them, else from
    ``pack_segment_ids`` and checked against the batch's ``cu_seqlens``."""
    metadata = batch_metadata(batch)
    if metadata is None:
        return describe_varlen(batch)
    cu_seqlens = carry_bounds(batch["cu_seqlens"].to(torch.int32), metadata.bounds)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
            "max_length_q": metadata.max_length, "max_length_k": metadata.max_length}


def describe_varlen(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The varlen kwargs computed from ``pack_segment_ids`` (in the step: reads device values back), checked against
    the batch's own ``cu_seqlens``."""
    varlen = flash_varlen_kwargs(batch["pack_segment_ids"])
    given = batch.get("cu_seqlens")
    if given is not None and not torch.equal(given.to(torch.int32).cpu(), varlen["cu_seq_lens_q"].cpu()):
        raise ValueError("batch cu_seqlens disagree with pack_segment_ids")
    return varlen
