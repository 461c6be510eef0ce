"""The model-family-independent half of ``prepare_packed`` / ``prepare_padded``.

A recipe's hooks turn a collated batch into model kwargs. Most of that is the same for every family and lives
here: unwrap the training wrapper, check that the batch is prepared for the backend the model actually runs, build
the backend's attention inputs from ``pack_segment_ids`` (4-D block-causal mask for eager/sdpa, a ``BlockMask`` for
flex_attention, ``cu_seq_lens_q/k`` + ``max_length_q/k`` for flash), check the batch's own ``position_ids`` and
``cu_seqlens`` against the segment ids, force ``use_cache=False``, and run every contamination guard. A hybrid
model with linear-attention layers (Qwen3.5) gets both in one call: the mask for its full-attention layers and the
samples' ``cu_seq_lens_q`` for its linear ones (``linear_attention``). A recipe adds
only what is model-specific: its positions (1-D for LLaVA, per-segment M-RoPE for Qwen2-VL) and its media kwargs.

Kwargs are built from scratch (never by copying the batch), so batch-only fields (``cu_seqlens``, ``max_seqlen``,
``sample_ids``, media owners, labels) cannot leak into the model; ``check_packed_model_kwargs`` proves it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES, MediaKind

from .attention import attention_mask_for, check_packed_model_kwargs, ensure_no_batch_fields, layer_masks
from .backends import ATTENTION_BACKENDS, SDPA_VARLEN, takes_varlen_kwargs
from .batch_metadata import batch_metadata, packed_varlen_kwargs
from .branches import batch_branches, branch_position_offsets, carry_pair_parts, same_branch_or_prefix
from .layer_types import LAYER_TYPES, SLIDING, has_layer_types, layer_predicates
from .linear_attention import BOUNDARIES, ensure_linear_attention_boundaries, has_linear_attention
from .mask_forms import CAUSAL
from .masks import Predicate
from .segments import segment_positions, validate_segment_ids
from .ulysses import inner_backend
from .unwrap import unwrap_model


def language_model_attn_implementation(model) -> str:
    """The attention implementation of the part that reads the packed mask: the text config's when the model has
    one (a vision tower may run another backend), else the model's own; under context parallelism the backend
    Ulysses runs on the whole row (the mask format is that backend's)."""
    config = unwrap_model(model).config
    text_config = getattr(config, "text_config", None)
    return inner_backend((text_config or config)._attn_implementation)


def check_model_backend(model, attn_implementation: str) -> None:
    """The batch must be prepared for the backend the language model runs: mask formats differ per backend."""
    configured = language_model_attn_implementation(model)
    if configured != attn_implementation:
        raise ValueError(
            f"model runs attn_implementation={configured!r} but the batch is prepared for {attn_implementation!r}: "
            "the mask format would not match (eager adds the mask, sdpa reads bool, flex needs a BlockMask, flash "
            "needs cu_seq_lens)"
        )


def text_positions(batch: Mapping[str, Any]) -> torch.Tensor:
    """(B, L) positions restarting at every segment, checked against the batch's own ``position_ids``; the batch's
    own where its collator checked them already (``batch_metadata.describe_packed`` runs this on the CPU)."""
    if batch_metadata(batch) is not None:
        return batch["position_ids"]
    segment_ids = batch["pack_segment_ids"]
    validate_segment_ids(segment_ids)
    positions = segment_positions(segment_ids)
    branches = batch_branches(batch)  # a preference pair's continuations both continue from its prefix
    if branches is not None:
        positions = positions - branch_position_offsets(segment_ids, branches)
    given = batch.get("position_ids")
    if given is not None and not torch.equal(given.to(positions.device), positions):
        raise ValueError("batch position_ids disagree with pack_segment_ids (expected a restart at every segment)")
    return positions


def media_owners(batch: Mapping[str, Any], n_items: int, kind: MediaKind = IMAGES) -> list[tuple[int, int]]:
    """``(row, segment)`` of every media item of ``kind``, required in row-major, segment order: models fill
    placeholders in the order of the flattened batch, so any other order would hand one sample another's image."""
    if n_items == 0:
        return []
    rows, segs = batch.get(kind.row_key), batch.get(kind.segment_key)
    if rows is None or segs is None:
        raise ValueError(f"a batch with {kind.patch_key} needs {kind.row_key} and {kind.segment_key}")
    owners = list(zip(rows.tolist(), segs.tolist()))
    if len(owners) != n_items:
        raise ValueError(f"{len(owners)} media owners ({kind.segment_key}) for {n_items} items")
    if owners != sorted(owners):
        raise ValueError("media must be concatenated in row-major, segment order (the model fills placeholders so)")
    return owners


def check_media_placement(batch: Mapping[str, Any], placeholder: torch.Tensor,
                          tokens_per_item: Sequence[int], kind: MediaKind = IMAGES) -> list[tuple[int, int]]:
    """Every segment holds exactly the placeholder tokens its own media items of ``kind`` need (``placeholder``:
    (B, L) bool, ``tokens_per_item``: placeholder tokens of each item in batch order); returns the items' owners."""
    owners = media_owners(batch, len(tokens_per_item), kind)
    needed: Counter = Counter()
    for owner, tokens in zip(owners, tokens_per_item):
        needed[owner] += int(tokens)
    rows, cols = placeholder.nonzero(as_tuple=True)
    have = Counter(zip(rows.tolist(), batch["pack_segment_ids"][rows, cols].tolist()))
    for row, seg in sorted(set(needed) | set(have)):
        if have[(row, seg)] != needed[(row, seg)]:
            items = sum(1 for owner in owners if owner == (row, seg))
            raise ValueError(f"row {row} segment {seg}: {have[(row, seg)]} {kind.name} tokens but its {items} "
                             f"{kind.name}(s) need {needed[(row, seg)]}")
    return owners


def packed_attention_kwargs(batch: Mapping[str, Any], attn_implementation: str, dtype: torch.dtype,
                            boundaries: bool = False, predicates: Mapping[str, Predicate] | None = None,
                            predicate: Predicate = CAUSAL, branches: torch.Tensor | None = None) -> dict:
    """The backend's attention inputs for a packed batch, all derived from ``pack_segment_ids``. ``boundaries``:
    also the samples' ``cu_seq_lens_q`` next to an eager/sdpa/flex mask (a hybrid model's linear-attention layers
    read them while its full-attention layers read the mask; flash and sdpa_varlen carry them anyway).
    ``predicates``: one mask per layer type instead (``layer_types.layer_predicates``), as the prepared dict;
    sdpa_varlen gets it as ``SpanMasks`` next to its varlen kwargs, flash cannot take it. ``predicate``: the one
    mask's predicate when it is more than causal (a preference pair's branches): eager, sdpa and flex. ``branches``:
    the pair branch ids behind that predicate, which sdpa_varlen takes instead of a mask, as each pair segment's
    part lengths carried by its ``cu_seq_lens`` (``branches.carry_pair_parts``); flash cannot take them."""
    segment_ids = batch["pack_segment_ids"]
    if predicate is not CAUSAL and predicates is None and takes_varlen_kwargs(attn_implementation):
        if attn_implementation == SDPA_VARLEN and branches is not None:
            varlen = packed_varlen_kwargs(batch)
            carry_pair_parts(varlen["cu_seq_lens_q"], branches)
            return varlen
        raise ValueError(f"{attn_implementation} cannot mask a preference pair's branches (each continuation sees "
                         f"the prefix, never the other): use {SDPA_VARLEN}, sdpa, eager or flex_attention")
    if predicates is not None:
        if takes_varlen_kwargs(attn_implementation) and attn_implementation != SDPA_VARLEN:
            raise ValueError(f"{attn_implementation} cannot take this model's per-layer masks (sliding window, "
                             f"bidirectional blocks): use {SDPA_VARLEN}, sdpa, eager or flex_attention")
        masks = {"attention_mask": layer_masks(segment_ids, predicates, attn_implementation, dtype)}
        extra = boundaries or attn_implementation == SDPA_VARLEN
        return {**packed_varlen_kwargs(batch), **masks} if extra else masks
    varlen = {}
    if boundaries or takes_varlen_kwargs(attn_implementation):
        varlen = packed_varlen_kwargs(batch)
    if takes_varlen_kwargs(attn_implementation):
        return varlen
    if attn_implementation not in ATTENTION_BACKENDS:
        raise NotImplementedError(f"packed attention for {attn_implementation!r} is not implemented")
    mask = {"attention_mask": attention_mask_for(segment_ids, attn_implementation, dtype, predicate)}
    return {**mask, BOUNDARIES: varlen[BOUNDARIES]} if boundaries else mask


def _pair_predicates(model, predicates: Mapping[str, Predicate] | None,
                     branches: torch.Tensor) -> tuple[dict[str, Predicate] | None, Predicate]:
    """The masks of a batch holding preference pairs: every predicate and'ed with ``same_branch_or_prefix``. Refused
    in one line where the branches are not exact: linear-attention layers (their recurrent state would run from the
    chosen continuation into the rejected one) and sliding windows (counted in row indices, not positions)."""
    if has_linear_attention(model) or (predicates is not None and SLIDING in predicates):
        what = "linear-attention" if has_linear_attention(model) else "sliding-window"
        raise ValueError(f"preference pairs are not supported on models with {what} layers yet: their two "
                         "continuations would not stay apart")
    pair = same_branch_or_prefix(branches)
    if predicates is None:
        return None, CAUSAL & pair
    return {layer_type: predicate & pair for layer_type, predicate in predicates.items()}, CAUSAL


def prepare_packed_inputs(
    batch: Mapping[str, Any],
    model,
    attn_implementation: str,
    *,
    position_ids: torch.Tensor,
    position_rows: int,
    media: Mapping[str, Any],
    supported: tuple[str, ...] = ATTENTION_BACKENDS,
    block_ids: torch.Tensor | None = None,
    block_layer_types: tuple[str, ...] = LAYER_TYPES,
) -> dict[str, Any]:
    """Model kwargs of a packed batch: ``input_ids``, the recipe's ``position_ids`` and ``media``, the backend's
    attention inputs and ``use_cache=False``, checked by every guard (``position_rows``: 1 for (B, L) positions,
    4 for Qwen2-VL's (4, B, L)). A language model with sliding-window layers, or given ``block_ids`` (bidirectional
    blocks on ``block_layer_types``, e.g. from ``layer_types.batch_type_blocks``), gets one mask per layer type,
    the window read from its text config now."""
    model = unwrap_model(model)
    if attn_implementation not in supported:
        raise NotImplementedError(f"packed attention for {attn_implementation!r} is not offered: {list(supported)}")
    check_model_backend(model, attn_implementation)
    text_config = model.config.get_text_config()
    predicates = (layer_predicates(text_config, block_ids, block_layer_types)
                  if block_ids is not None or has_layer_types(text_config) else None)
    predicate, branches = CAUSAL, batch_branches(batch)
    if branches is not None:
        predicates, predicate = _pair_predicates(model, predicates, branches)
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": position_ids,
        "use_cache": False,
        **media,
        **packed_attention_kwargs(batch, attn_implementation, model.dtype, boundaries=has_linear_attention(model),
                                  predicates=predicates, predicate=predicate, branches=branches),
    }
    check_packed_model_kwargs(kwargs, attn_implementation, position_rows=position_rows)
    ensure_linear_attention_boundaries(model, kwargs)
    return kwargs


def prepare_padded_inputs(
    batch: Mapping[str, Any], model, attn_implementation: str, *, media: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """Model kwargs of the unpacked baseline: one sample per row, a 2-D padding mask, positions left to the model,
    ``use_cache=False``, plus the recipe's ``media`` and ``extra`` kwargs."""
    model = unwrap_model(model)
    check_model_backend(model, attn_implementation)
    segment_ids = batch["pack_segment_ids"]
    validate_segment_ids(segment_ids)
    if bool((segment_ids > 0).any()):
        rows = sorted(set((segment_ids > 0).nonzero()[:, 0].tolist()))
        raise ValueError(f"prepare_padded got packed rows {rows} (more than one segment); use prepare_packed")
    kwargs = {
        "input_ids": batch["input_ids"],
        "attention_mask": (segment_ids >= 0).long(),
        "use_cache": False,
        **media,
        **extra,
    }
    ensure_no_batch_fields(kwargs)
    return kwargs
