"""Model-free attention helpers for packed batches: masks per backend and contamination guards.

Everything derives from ``pack_segment_ids`` (``segments.py``); masks are predicates (``masks.py``) emitted in each
backend's form (``mask_forms.py``). The block-causal default confines attention to runs; the padding run is its own
block (it attends only to itself, causally, which also keeps every softmax row non-empty: no NaNs).

Facts about transformers 5.24 these helpers are built on (read from ``masking_utils.py``,
``modeling_flash_attention_utils.py``, ``integrations/sdpa_attention.py``):

- ``create_causal_mask`` returns any 4-D ``attention_mask`` unchanged (``_preprocess_mask_arguments`` early exit),
  so a ready (B, 1, L, L) mask reaches the attention function as is.
- sdpa accepts a bool mask (True = attend; transformers' own ``sdpa_mask`` builds bool) or an additive float one.
- eager does ``attn_weights + attention_mask``: it needs an additive float mask (0 / ``finfo(dtype).min``, as
  transformers' ``eager_mask`` builds). A bool mask there is silently *added* as 0/1: a guard refuses it.
- flash: ``_flash_attention_forward`` uses ``cu_seq_lens_q/k`` + ``max_length_q/k`` (all four needed) over the
  flattened (B*L) tokens, but only when ``attention_mask`` is None: a 2-D mask takes precedence (unpad path) and
  the segment boundaries are silently dropped.
- Packed detection from positions (``find_packed_sequence_indices``: a new sequence wherever the position step is
  not +1) runs only when ``attention_mask is None and cache is None``; ``use_cache`` left at None means True from
  the config, so a ``DynamicCache`` is created and packing is silently ignored.
- Multimodal ``get_*_features`` decorated with ``accepts_precomputed_kwargs`` (Qwen2-VL) drop unprefixed
  ``cu_seq_lens_q/k``/``max_length_q/k`` but pass ``cu_seqlens``/``max_seqlen`` on to the vision encoder, which pops
  and uses them as its *own* patch boundaries: the batch fields with those names must never be forwarded to a model.
  Undecorated ones (LLaVA) hand *every* extra kwarg, the flash varlen ones included, to the vision tower.
- flex_attention: ``create_causal_mask`` returns a ``BlockMask`` (4-D ``.shape``) unchanged, like a 4-D tensor, and
  ``flex_attention_forward`` uses it as the ``block_mask``; a *tensor* mask there is added to the scores
  (``score_mod``), so a bool one would be silently added as 0/1: a guard refuses it. torch's FlexAttention has no
  CPU backward (forward only on CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mvp_engine.kit.mllm.data.collator import BATCH_ONLY_FIELDS

from .backends import FLEX, SDPA_VARLEN, takes_varlen_kwargs
from .mask_forms import CAUSAL, FLEX_BLOCK_SIZE, SpanMasks, block_mask, dense_mask, span_masks
from .masks import Predicate

# The collator's batch-only fields: some a transformers model would consume with another meaning (cu_seqlens,
# max_seqlen), the rest only the engine reads (bookkeeping, labels: the engine computes the loss from the logits).
FORBIDDEN_MODEL_KWARGS = tuple(sorted(BATCH_ONLY_FIELDS))


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, 1, L, L) block-causal mask: query q sees key k iff k <= q and both are in the same run (bool for
    ``dtype=None``, additive for a floating ``dtype``; :func:`~.mask_forms.dense_mask` of ``causal()``)."""
    return dense_mask(segment_ids, CAUSAL, dtype)


def flex_block_mask(segment_ids: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE):
    """A flex-attention ``BlockMask`` with exactly :func:`block_causal_mask`'s pattern, built at block granularity
    (:func:`~.mask_forms.block_mask` of ``causal()``; the padding run sees only itself, so no row is fully masked)."""
    return block_mask(segment_ids, CAUSAL, block_size)


def is_block_mask(mask: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(mask, BlockMask)


def attention_mask_for(segment_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype,
                       predicate: Predicate = CAUSAL):
    """The mask of ``predicate`` (block-causal by default) in the form ``attn_implementation`` consumes: eager an
    additive float 4-D tensor, sdpa a bool 4-D tensor, flex_attention a ``BlockMask``, sdpa_varlen ``SpanMasks``."""
    if attn_implementation == "eager":
        return dense_mask(segment_ids, predicate, dtype)
    if attn_implementation == "sdpa":
        return dense_mask(segment_ids, predicate)
    if attn_implementation == FLEX:
        return block_mask(segment_ids, predicate)
    if attn_implementation == SDPA_VARLEN:
        return span_masks(segment_ids, predicate)
    raise ValueError(f"no explicit mask for attn_implementation={attn_implementation!r} (eager, sdpa, "
                     f"{SDPA_VARLEN} or {FLEX} only; flash packs through cu_seq_lens)")


def layer_masks(segment_ids: torch.Tensor, predicates: Mapping[str, Predicate], attn_implementation: str,
                dtype: torch.dtype) -> dict[str, Any]:
    """One mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``), the prepared dict hybrid
    models (Gemma 3 / 4) take as ``attention_mask`` and then build no mask of their own."""
    return {layer_type: attention_mask_for(segment_ids, attn_implementation, dtype, predicate)
            for layer_type, predicate in predicates.items()}


def sub_model_attention(attn_implementation: str, vision_shares: tuple[str, ...] = ("eager", "sdpa")) -> dict[str, str]:
    """Backend per sub-model: the language model runs ``attn_implementation``; the vision tower runs it too when it
    is in ``vision_shares``, else sdpa (varlen kwargs meant for the language model must never be read by a vision
    tower as its own boundaries, and flex would only add compilation there)."""
    vision = attn_implementation if attn_implementation in vision_shares else "sdpa"
    return {"": attn_implementation, "text_config": attn_implementation, "vision_config": vision}


# ------------------------------------------------------------------------------------------------------- guards


def ensure_no_cache(kwargs: Mapping[str, Any]) -> None:
    """Packed positions and masks are ignored while a cache is in use, and ``use_cache=None`` means the config's
    default (True): require an explicit ``use_cache=False`` and no cache object."""
    if kwargs.get("use_cache") is not False:
        raise ValueError(
            f"packed forward needs use_cache=False (got {kwargs.get('use_cache')!r}): with a cache, transformers "
            "ignores packed position_ids and builds a plain causal mask across samples"
        )
    for key in ("past_key_values", "cache"):
        if kwargs.get(key) is not None:
            raise ValueError(f"packed forward must not get {key}: packing is ignored when a cache is in use")


def ensure_position_rows(position_ids: torch.Tensor | None, rows: int | None) -> None:
    """``rows=4`` (Qwen2-VL M-RoPE): position_ids must be (4, B, L), text row first; 2-D or 3-row positions
    never trigger packed handling in the model. ``rows=1``: plain (B, L). ``None``: no check."""
    if rows is None:
        return
    if position_ids is None:
        raise ValueError("packed forward needs explicit position_ids")
    if rows == 1:
        if position_ids.dim() != 2:
            raise ValueError(f"packed forward needs (B, L) position_ids, got {tuple(position_ids.shape)}")
        return
    if position_ids.dim() != 3 or position_ids.shape[0] != rows:
        raise ValueError(
            f"packed forward on this model needs ({rows}, B, L) position_ids (text row + M-RoPE rows), got "
            f"{tuple(position_ids.shape)}: 2-D or 3-row positions make the model treat each row as one sequence"
        )


def ensure_mask_fits(attention_mask, attn_implementation: str) -> None:
    """Packing forbids a 2-D ``attention_mask`` (an all-ones one disables packed detection; any one makes flash
    ignore ``cu_seq_lens``); eager needs its 4-D mask additive, not bool; flex_attention needs a ``BlockMask`` and
    nothing else takes one; ``SpanMasks`` are sdpa_varlen's alone. A per-layer-type dict is checked mask by mask."""
    if attention_mask is None:
        return
    if isinstance(attention_mask, Mapping):
        for mask in attention_mask.values():
            ensure_mask_fits(mask, attn_implementation)
        return
    if isinstance(attention_mask, SpanMasks):
        if attn_implementation != SDPA_VARLEN:
            raise ValueError(f"SpanMasks are read by {SDPA_VARLEN} only, got attn_implementation="
                             f"{attn_implementation!r}")
        return
    if is_block_mask(attention_mask) != (attn_implementation == FLEX):
        raise ValueError(
            f"{FLEX} packs through a BlockMask (a tensor mask would be added to its scores) and only it can read one: "
            f"got {type(attention_mask).__name__} for attn_implementation={attn_implementation!r}"
        )
    if is_block_mask(attention_mask):
        return
    if attention_mask.dim() == 2:
        raise ValueError(
            "packed forward must not get a 2-D attention_mask: it disables transformers' packed detection and "
            "makes flash attention ignore cu_seq_lens, so samples attend to each other"
        )
    if takes_varlen_kwargs(attn_implementation):
        raise ValueError(f"{attn_implementation} packs through cu_seq_lens_q/k; pass no attention_mask")
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D (B, 1, L, L) for packing, got {tuple(attention_mask.shape)}")
    if attn_implementation == "eager" and attention_mask.dtype == torch.bool:
        raise ValueError("eager attention adds the mask to the scores: pass an additive float mask, not bool")


def ensure_no_batch_fields(kwargs: Mapping[str, Any]) -> None:
    """The batch's ``cu_seqlens``/``max_seqlen`` would be taken by a vision encoder as its own patch boundaries; the
    other batch-only fields (bookkeeping, owners of media, labels) are the engine's, never a model's."""
    leaked = [key for key in FORBIDDEN_MODEL_KWARGS if key in kwargs]
    if leaked:
        raise ValueError(
            f"model kwargs must not contain the batch-only fields {leaked}: multimodal encoders consume "
            "cu_seqlens/max_seqlen as their own; flash attention takes cu_seq_lens_q/k and max_length_q/k"
        )


def check_packed_model_kwargs(
    kwargs: Mapping[str, Any],
    attn_implementation: str,
    position_rows: int | None = None,
    explicit_mask: bool = True,
) -> None:
    """All guards against silent cross-sample contamination, on the kwargs about to go to the model.

    ``explicit_mask``: eager/sdpa/flex forwards must carry the block-causal mask (set False only for a recipe that
    proved transformers' own position-based packed detection equivalent by test).
    """
    ensure_no_cache(kwargs)
    ensure_position_rows(kwargs.get("position_ids"), position_rows)
    ensure_mask_fits(kwargs.get("attention_mask"), attn_implementation)
    ensure_no_batch_fields(kwargs)
    if takes_varlen_kwargs(attn_implementation):
        missing = [k for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if k not in kwargs]
        if missing:
            raise ValueError(f"packed {attn_implementation} forward is missing {missing}")
    elif explicit_mask and kwargs.get("attention_mask") is None:
        raise ValueError(f"packed {attn_implementation} forward needs an explicit 4-D block-causal attention_mask "
                         f"(a BlockMask for {FLEX})")
