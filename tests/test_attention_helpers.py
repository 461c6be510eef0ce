"""The generic packed-attention helpers (``mvp_engine.packing``), checked against transformers' own utilities."""

from __future__ import annotations

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
    check_packed_model_kwargs,
    ensure_mask_fits,
    ensure_no_batch_fields,
    ensure_no_cache,
    ensure_position_rows,
    flash_varlen_kwargs,
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
@given(rows_strategy, st.integers(0, 3))
def test_block_causal_mask_matches_transformers_packed_mask(rows, extra):
    length = max(sum(r) for r in rows) + extra
    if length == 0:
        return
    segment_ids = segment_ids_from_lengths(rows, length)
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
    with pytest.raises(ValueError, match="eager or sdpa"):
        attention_mask_for(EXAMPLE, "flex_attention", torch.float32)


def test_masked_softmax_has_no_nans():
    scores = torch.randn(3, 1, 6, 6) + block_causal_mask(EXAMPLE, dtype=torch.float32)
    assert torch.isfinite(scores.softmax(-1)).all()
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4), attn_mask=block_causal_mask(EXAMPLE)
    )
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------------ flash varlen


def test_flash_varlen_kwargs_by_hand():
    kwargs = flash_varlen_kwargs(EXAMPLE)
    expected = torch.tensor([0, 3, 5, 6, 10, 12, 13, 14, 15, 16, 17, 18], dtype=torch.int32)
    assert torch.equal(kwargs["cu_seq_lens_q"], expected) and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    assert isinstance(kwargs["max_length_q"], int)


@settings(max_examples=60, deadline=None)
@given(rows_strategy, st.integers(0, 3))
def test_flash_varlen_kwargs_match_transformers(rows, extra):
    length = max(sum(r) for r in rows) + extra
    if length == 0:
        return
    segment_ids = segment_ids_from_lengths(rows, length)
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


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_good_kwargs_pass(attn):
    check_packed_model_kwargs(_good_kwargs(attn), attn, position_rows=4)


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
