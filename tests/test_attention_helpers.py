"""The generic packed-attention helpers (``mvp_engine.packing``), checked against transformers' own utilities."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    remap_positions_for_packed_sequence,
    sdpa_mask,
)
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from mvp_engine.packing import (
    attention_mask_for,
    block_causal_mask,
    check_media_placement,
    check_packed_model_kwargs,
    ensure_mask_fits,
    ensure_no_batch_fields,
    ensure_no_cache,
    ensure_position_rows,
    flash_varlen_kwargs,
    flex_block_mask,
    is_block_mask,
    row_segments,
    segment_positions,
    validate_segment_ids,
)


def segment_ids_from_lengths(rows: list[list[int]], length: int) -> torch.Tensor:
    """(B, L) ids: segment i of a row spans lengths[i] tokens, the rest of the row is padding (-1)."""
    out = torch.full((len(rows), length), -1, dtype=torch.long)
    for b, lengths in enumerate(rows):
        pos = 0
        for i, n in enumerate(lengths):
            out[b, pos:pos + n] = i
            pos += n
    return out


EXAMPLE = segment_ids_from_lengths([[3, 2], [4], [1, 1, 1, 1, 1, 1]], length=6)


def transformers_packed_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """What ``create_causal_mask`` builds for sdpa from packed positions (its own detection + remapping)."""
    positions = segment_positions(segment_ids)
    batch, length = segment_ids.shape
    mask_function = remap_positions_for_packed_sequence(causal_mask_function, positions)
    packed = find_packed_sequence_indices(positions)
    if packed is not None:
        mask_function = and_masks(mask_function, packed_sequence_mask_function(packed))
    return sdpa_mask(batch_size=batch, q_length=length, kv_length=length, mask_function=mask_function,
                     allow_is_causal_skip=False)


rows_strategy = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=4), min_size=1, max_size=3)


@st.composite
def segment_ids_strategy(draw) -> torch.Tensor:
    """(B, L) segment ids of up to 3 rows of up to 4 segments, then 0..3 extra padding (never an empty batch)."""
    rows = draw(rows_strategy)
    length = max(sum(r) for r in rows) + draw(st.integers(0 if any(map(any, rows)) else 1, 3))
    return segment_ids_from_lengths(rows, length)


# ----------------------------------------------------------------------------------------------- positions, runs


def test_segment_positions_restart_per_segment_and_padding_run():
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1], [0, 0, 0, 0, 0, 0]])
    assert torch.equal(segment_positions(EXAMPLE), expected)


def test_row_segments():
    assert row_segments(EXAMPLE)[0] == [(0, 0, 3), (1, 3, 5), (-1, 5, 6)]
    assert row_segments(EXAMPLE)[1] == [(0, 0, 4), (-1, 4, 6)]


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor([0, 0, -1]), r"\(B, L\)"),
        (torch.tensor([[0, -2, -1]]), ">= -1"),
        (torch.tensor([[0, -1, 1]]), "trailing"),
    ],
)
def test_validate_segment_ids_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_segment_ids(bad)


# ----------------------------------------------------------------------------------------------------- 4-D masks


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(EXAMPLE)
    assert mask.shape == (3, 1, 6, 6) and mask.dtype == torch.bool
    row0 = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # the padding token sees only itself
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], row0)
    assert torch.equal(mask[2, 0], torch.eye(6, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(segment_ids_strategy())
def test_block_causal_mask_matches_transformers_packed_mask(segment_ids):
    mask = block_causal_mask(segment_ids)
    assert torch.equal(mask, transformers_packed_mask(segment_ids).expand_as(mask))
    assert mask.any(-1).all(), "a fully masked query row would give NaNs"
    is_pad = segment_ids < 0
    real_sees_pad = mask[:, 0] & ~is_pad[:, :, None] & is_pad[:, None, :]
    pad_sees_real = mask[:, 0] & is_pad[:, :, None] & ~is_pad[:, None, :]
    assert not real_sees_pad.any() and not pad_sees_real.any()


def test_additive_mask_for_eager():
    additive = block_causal_mask(EXAMPLE, dtype=torch.float32)
    allowed = block_causal_mask(EXAMPLE)
    assert additive.dtype == torch.float32
    assert torch.equal(additive == 0, allowed)
    assert torch.all(additive[~allowed] == torch.finfo(torch.float32).min)
    assert torch.equal(attention_mask_for(EXAMPLE, "eager", torch.float32), additive)
    assert torch.equal(attention_mask_for(EXAMPLE, "sdpa", torch.float32), allowed)
    assert is_block_mask(attention_mask_for(EXAMPLE, "flex_attention", torch.float32))
    with pytest.raises(ValueError, match="cu_seq_lens"):
        attention_mask_for(EXAMPLE, "flash_attention_2", torch.float32)


def test_masked_softmax_has_no_nans():
    scores = torch.randn(3, 1, 6, 6) + block_causal_mask(EXAMPLE, dtype=torch.float32)
    assert torch.isfinite(scores.softmax(-1)).all()
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4), attn_mask=block_causal_mask(EXAMPLE)
    )
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- flex BlockMask


def dense_block_mask(block_mask) -> torch.Tensor:
    """The (B, 1, L, L) bool pattern a BlockMask's ``mask_mod`` stands for, token by token."""
    from torch.nn.attention.flex_attention import create_mask

    batch, _, q_len, kv_len = block_mask.shape
    return create_mask(block_mask.mask_mod, batch, 1, q_len, kv_len, device="cpu")


@settings(max_examples=25, deadline=None)
@given(segment_ids_strategy())
def test_flex_block_mask_is_the_block_causal_pattern(segment_ids):
    block_mask = flex_block_mask(segment_ids)
    batch, length = segment_ids.shape
    assert is_block_mask(block_mask) and tuple(block_mask.shape) == (batch, 1, length, length)
    # the same pattern as the 4-D mask, so the same proofs hold: padding attends to nothing real (and nothing real
    # to padding), no query row is fully masked (test_block_causal_mask_matches_transformers_packed_mask)
    assert torch.equal(dense_block_mask(block_mask), block_causal_mask(segment_ids))


def test_flex_attention_with_block_mask_equals_sdpa_with_4d_mask():
    """Eager (uncompiled) flex_attention on CPU: the BlockMask confines attention exactly like the 4-D mask."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(3, 2, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": intended here
        out = flex_attention(q, k, v, block_mask=flex_block_mask(EXAMPLE))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(EXAMPLE))
    assert (out - ref).abs().max().item() <= 1e-6


def test_transformers_passes_a_block_mask_through_unchanged():
    """Llama (and every ``create_causal_mask`` user) hands a ready 4-D BlockMask to flex_attention as is."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
    config._attn_implementation = "flex_attention"
    block_mask = flex_block_mask(EXAMPLE)
    embeds = torch.zeros(3, 6, 8)
    out = create_causal_mask(config, embeds, block_mask, None, position_ids=segment_positions(EXAMPLE))
    assert out is block_mask


# ------------------------------------------------------------------------------------------------ flash varlen


def test_flash_varlen_kwargs_by_hand():
    kwargs = flash_varlen_kwargs(EXAMPLE)
    expected = torch.tensor([0, 3, 5, 6, 10, 12, 13, 14, 15, 16, 17, 18], dtype=torch.int32)
    assert torch.equal(kwargs["cu_seq_lens_q"], expected) and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    assert isinstance(kwargs["max_length_q"], int)


@settings(max_examples=60, deadline=None)
@given(segment_ids_strategy())
def test_flash_varlen_kwargs_match_transformers(segment_ids):
    ours = flash_varlen_kwargs(segment_ids)
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(segment_positions(segment_ids).reshape(1, -1))
    assert torch.equal(ours["cu_seq_lens_q"], cu_q)
    assert ours["max_length_q"] == int(max_q)


# ------------------------------------------------------------------------------------------------------- guards


def _good_kwargs(attn="sdpa"):
    kwargs = {"input_ids": torch.zeros(3, 6, dtype=torch.long), "use_cache": False,
              "position_ids": segment_positions(EXAMPLE).unsqueeze(0).repeat(4, 1, 1)}
    if attn.startswith("flash"):
        kwargs.update(flash_varlen_kwargs(EXAMPLE))
    else:
        kwargs["attention_mask"] = attention_mask_for(EXAMPLE, attn, torch.float32)
    return kwargs


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex_attention", "flash_attention_2"])
def test_good_kwargs_pass(attn):
    check_packed_model_kwargs(_good_kwargs(attn), attn, position_rows=4)


def test_guard_flex_mask_form():
    with pytest.raises(ValueError, match="BlockMask"):
        ensure_mask_fits(block_causal_mask(EXAMPLE), "flex_attention")  # a bool tensor would be added to scores
    with pytest.raises(ValueError, match="BlockMask"):
        ensure_mask_fits(flex_block_mask(EXAMPLE), "sdpa")
    kwargs = _good_kwargs("flex_attention")
    del kwargs["attention_mask"]
    with pytest.raises(ValueError, match="block-causal"):
        check_packed_model_kwargs(kwargs, "flex_attention", position_rows=4)


@pytest.mark.parametrize("bad", [{"use_cache": True}, {"use_cache": None}, {"past_key_values": object()},
                                 {"cache": object()}])
def test_guard_cache(bad):
    with pytest.raises(ValueError, match="cache"):
        ensure_no_cache({**_good_kwargs(), **bad})


def test_guard_position_rows():
    positions = segment_positions(EXAMPLE)
    with pytest.raises(ValueError, match=r"\(4, B, L\)"):
        ensure_position_rows(positions, 4)  # 2-D
    with pytest.raises(ValueError, match=r"\(4, B, L\)"):
        ensure_position_rows(positions.unsqueeze(0).repeat(3, 1, 1), 4)  # 3-row
    with pytest.raises(ValueError, match="explicit position_ids"):
        ensure_position_rows(None, 4)
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        ensure_position_rows(positions.unsqueeze(0), 1)
    ensure_position_rows(positions, 1)
    ensure_position_rows(None, None)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_guard_2d_attention_mask(attn):
    with pytest.raises(ValueError, match="2-D attention_mask"):
        ensure_mask_fits(torch.ones(3, 6, dtype=torch.long), attn)


def test_guard_mask_form():
    with pytest.raises(ValueError, match="additive"):
        ensure_mask_fits(block_causal_mask(EXAMPLE), "eager")
    with pytest.raises(ValueError, match="cu_seq_lens"):
        ensure_mask_fits(block_causal_mask(EXAMPLE), "flash_attention_2")
    with pytest.raises(ValueError, match="4-D"):
        ensure_mask_fits(torch.ones(3, 6, 6, dtype=torch.bool), "sdpa")


def test_guard_batch_fields():
    with pytest.raises(ValueError, match="cu_seqlens"):
        ensure_no_batch_fields({"cu_seqlens": torch.tensor([0, 6])})
    with pytest.raises(ValueError, match="max_seqlen"):
        ensure_no_batch_fields({"max_seqlen": 6})
    with pytest.raises(ValueError, match="sample_ids"):
        ensure_no_batch_fields({"sample_ids": [["a"]]})


def test_media_placement():
    placeholder = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    segments = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, -1, -1, -1]])
    batch = {"pack_segment_ids": segments, "media_batch_index": torch.tensor([0, 1]),
             "media_segment_ids": torch.tensor([0, 0])}
    assert check_media_placement(batch, placeholder, [2, 1]) == [(0, 0), (1, 0)]
    with pytest.raises(ValueError, match="row 0 segment 0: 2 image tokens but its 1 image"):
        check_media_placement(batch, placeholder, [3, 1])
    with pytest.raises(ValueError, match="row-major"):
        check_media_placement({**batch, "media_batch_index": torch.tensor([1, 0])}, placeholder, [2, 1])
    with pytest.raises(ValueError, match="media_batch_index"):
        check_media_placement({"pack_segment_ids": segments}, placeholder, [2, 1])


def test_guard_missing_attention_inputs():
    kwargs = _good_kwargs("flash_attention_2")
    del kwargs["max_length_k"]
    with pytest.raises(ValueError, match="max_length_k"):
        check_packed_model_kwargs(kwargs, "flash_attention_2", position_rows=4)
    kwargs = _good_kwargs("sdpa")
    del kwargs["attention_mask"]
    with pytest.raises(ValueError, match="4-D block-causal"):
        check_packed_model_kwargs(kwargs, "sdpa", position_rows=4)
    check_packed_model_kwargs(kwargs, "sdpa", position_rows=4, explicit_mask=False)


def selected_blocks(num: torch.Tensor, indices: torch.Tensor, blocks: int) -> torch.Tensor:
    """(B, q blocks, kv blocks) bool of the key blocks a BlockMask lists per query block."""
    batch = num.shape[0]
    out = torch.zeros(batch, blocks, blocks, dtype=torch.bool)
    for b in range(batch):
        for qb in range(blocks):
            out[b, qb, indices[b, 0, qb, : int(num[b, 0, qb])].long()] = True
    return out


@settings(max_examples=80, deadline=None)
@given(segment_ids_strategy(), st.sampled_from([1, 2, 3, 4]))
def test_flex_block_mask_lists_exactly_the_blocks_with_allowed_pairs(segment_ids, block_size):
    """Built from run boundaries (no L x L tensor). With small blocks every block-pair case occurs: the listed blocks
    (partial or full) are exactly those holding an allowed (q, k) pair, and a full block (mask function skipped) holds
    only allowed pairs. (Eager flex on CPU applies the mask function everywhere, so only this catches a wrong list.)"""
    batch, length = segment_ids.shape
    mask = flex_block_mask(segment_ids, block_size=block_size)
    blocks = -(-length // block_size)
    partial = selected_blocks(mask.kv_num_blocks, mask.kv_indices, blocks)
    full = selected_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, blocks)
    allowed = block_causal_mask(segment_ids)[:, 0]
    padded = torch.zeros(batch, blocks * block_size, blocks * block_size, dtype=torch.bool)
    padded[:, :length, :length] = allowed
    per_block = padded.reshape(batch, blocks, block_size, blocks, block_size)
    any_allowed = per_block.any(dim=(2, 4))
    inside = torch.zeros_like(padded)
    inside[:, :length, :length] = True
    all_allowed = (per_block | ~inside.reshape_as(per_block)).all(dim=(2, 4))
    assert not (partial & full).any()
    assert torch.equal(partial | full, any_allowed)
    assert not (full & ~all_allowed).any()
