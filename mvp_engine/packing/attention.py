"""Model-free attention helpers for packed batches: masks, flash varlen kwargs and contamination guards.

Everything derives from ``pack_segment_ids`` (B, L): segment index within the row, -1 for the trailing padding.
A *run* is a maximal stretch of equal ids in a row; runs are what attention is confined to, so the padding run
is its own block (it attends only to itself, causally, which also keeps every softmax row non-empty: no NaNs).

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

from .backends import FLEX, takes_varlen_kwargs

# The collator's batch-only fields: some a transformers model would consume with another meaning (cu_seqlens,
# max_seqlen), the rest only the engine reads (bookkeeping, labels: the engine computes the loss from the logits).
FORBIDDEN_MODEL_KWARGS = tuple(sorted(BATCH_ONLY_FIELDS))


def validate_segment_ids(segment_ids: torch.Tensor) -> None:
    """Refuse layouts the helpers do not support: not (B, L), ids below -1, or padding before a real token."""
    if segment_ids.dim() != 2:
        raise ValueError(f"pack_segment_ids must be (B, L), got shape {tuple(segment_ids.shape)}")
    if segment_ids.numel() and int(segment_ids.min()) < -1:
        raise ValueError("pack_segment_ids must be >= -1 (-1 marks padding)")
    is_pad = segment_ids < 0
    if bool((is_pad[:, :-1] & ~is_pad[:, 1:]).any()):
        raise ValueError("pack_segment_ids: padding (-1) must form one trailing run per row")


def segment_run_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) index of the run each token is in (0 at the start of every row)."""
    change = torch.zeros_like(segment_ids, dtype=torch.long)
    change[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
    return change.cumsum(-1)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) positions restarting at 0 at every run (the padding run gets one fresh run 0, 1, 2, ...)."""
    runs = segment_run_ids(segment_ids)
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(runs)
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = runs[:, 1:] != runs[:, :-1]
    starts = torch.where(is_start, index, torch.zeros_like(index)).cummax(-1).values
    return index - starts


def row_segments(segment_ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per row, the ``(segment_id, start, end)`` of every run, padding included (id -1), in order."""
    out = []
    for row in segment_ids.tolist():
        runs: list[tuple[int, int, int]] = []
        for i, seg in enumerate(row):
            if runs and runs[-1][0] == seg:
                runs[-1] = (seg, runs[-1][1], i + 1)
            else:
                runs.append((seg, i, i + 1))
        out.append(runs)
    return out


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, 1, L, L) block-causal mask: query q sees key k iff k <= q and both are in the same run.

    ``dtype=None`` gives bool (True = attend), the form transformers builds for sdpa; a floating ``dtype`` gives
    the additive form eager needs (0 where attended, ``finfo(dtype).min`` elsewhere).
    """
    validate_segment_ids(segment_ids)
    runs = segment_run_ids(segment_ids)
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (runs[:, :, None] == runs[:, None, :]) & causal
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=segment_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def flex_block_mask(segment_ids: torch.Tensor, block_size: int = 128):
    """A flex-attention ``BlockMask`` (B, 1, L, L) with exactly :func:`block_causal_mask`'s pattern: query q sees key
    k iff k <= q and both are in the same run (the padding run sees only itself, so no row is fully masked).

    Built straight from the run boundaries at block granularity, never through an L x L tensor: uncompiled
    ``create_block_mask`` evaluates the mask function on every (q, k) pair (B x L x L; +10 GiB at L = 32 k), while
    here a block pair's fate follows from the runs at its two ends (runs only grow along a row): it is skipped when
    its query and key runs do not overlap or it lies above the diagonal, *full* (no mask function applied) when
    both blocks lie inside one run below the diagonal, and *partial* otherwise. Cost: (L / block_size)^2 per row.
    """
    from torch.nn.attention.flex_attention import BlockMask

    validate_segment_ids(segment_ids)
    runs = segment_run_ids(segment_ids)
    batch, length = segment_ids.shape
    device = segment_ids.device
    blocks = -(-length // block_size)
    starts = torch.arange(blocks, device=device) * block_size
    ends = (starts + block_size).clamp(max=length) - 1
    first, last = runs[:, starts], runs[:, ends]  # (B, blocks): runs at each block's first and last token
    q_first, q_last, k_first, k_last = first[:, :, None], last[:, :, None], first[:, None, :], last[:, None, :]
    index = torch.arange(blocks, device=device)
    below = index[None, :, None] > index[None, None, :]
    whole = ((ends - starts + 1) == block_size)  # a block cut by the row's end is never full
    overlap = (torch.maximum(q_first, k_first) <= torch.minimum(q_last, k_last)) & (below | torch.eye(
        blocks, dtype=torch.bool, device=device))
    full = overlap & below & (q_first == q_last) & (k_first == k_last) & (q_first == k_first) \
        & whole[None, :, None] & whole[None, None, :]
    partial = overlap & ~full

    def as_kv_blocks(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query block: how many key blocks are selected, and their indices first (stable order)."""
        counts = selected.sum(-1, dtype=torch.int32)
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    def same_run_causal(b, h, q_idx, kv_idx):
        return (runs[b, q_idx] == runs[b, kv_idx]) & (kv_idx <= q_idx)

    kv_num, kv_indices = as_kv_blocks(partial)
    full_num, full_indices = as_kv_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block_size,
                                    mask_mod=same_run_causal, seq_lengths=(length, length))


def is_block_mask(mask: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(mask, BlockMask)


def attention_mask_for(segment_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """The explicit block-causal mask in the form ``attn_implementation`` consumes: eager an additive float 4-D
    tensor, sdpa a bool 4-D tensor, flex_attention a ``BlockMask``."""
    if attn_implementation == "eager":
        return block_causal_mask(segment_ids, dtype=dtype)
    if attn_implementation == "sdpa":
        return block_causal_mask(segment_ids)
    if attn_implementation == FLEX:
        return flex_block_mask(segment_ids)
    raise ValueError(f"no explicit mask for attn_implementation={attn_implementation!r} (eager, sdpa or "
                     f"{FLEX} only; flash packs through cu_seq_lens)")


def flash_varlen_kwargs(segment_ids: torch.Tensor) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int) over the flattened (B*L) tokens, one sequence per
    run (each row's padding run included), for transformers' flash-attention varlen path."""
    validate_segment_ids(segment_ids)
    batch, length = segment_ids.shape
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = is_start.reshape(-1).nonzero().view(-1)
    total = torch.tensor([batch * length], device=segment_ids.device)
    cu_seq_lens = torch.cat([starts, total]).to(torch.int32)
    max_length = int(cu_seq_lens.diff().max()) if cu_seq_lens.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


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
    nothing else takes one."""
    if attention_mask is None:
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
