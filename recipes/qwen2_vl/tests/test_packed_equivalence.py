"""Packed Qwen2-VL forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``), plus what is Qwen2-VL's own:
golden per-segment M-RoPE positions, transformers' packed detection, the padded baseline, guards and the traps.

Everything runs on the tiny random model (``conf/model/qwen2_vl_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.testing import collate_rows
from mvp_engine.engine.testkit.suites import EquivalenceSuite
from mvp_engine.packing import check_packed_model_kwargs
from recipes.qwen import mm_token_type_ids, packed_position_ids
from recipes.qwen2_vl.model import build_model
from recipes.qwen2_vl.packed import prepare_packed, prepare_padded

from .conftest import hand_collate

TOL = 1e-5
BACKENDS = ["eager", "sdpa"]


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen2_vl"


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tiny_cfg):
    out = {}
    for backend in BACKENDS:
        model = build_model(tiny_cfg, backend)
        model.eval()
        out[backend] = model
    return out


@pytest.fixture(scope="module")
def packed_rows(samples):
    """Two packed rows: [image, text-only, multi-image] and [text-only, image]; both end in padding."""
    return [[samples[0], samples[1], samples[2]], [samples[3], samples[4]]]


@pytest.fixture(scope="module")
def packed_batch(packed_rows, processor):
    batch = collate_rows(packed_rows, processor.pad_token_id)
    assert (batch["pack_segment_ids"][:, -1] == -1).all(), "every row must end in padding"
    return batch


def one_by_one_logits(model, sample) -> torch.Tensor:
    """The reference: the sample alone, positions computed by the model itself."""
    input_ids = sample.input_ids.unsqueeze(0)
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if sample.num_media:
        kwargs.update(sample.media, mm_token_type_ids=mm_token_type_ids(input_ids, model.config))
    with torch.no_grad():
        return model(**kwargs).logits[0]


# --------------------------------------------------------------------------------- backing the choices in packed.py


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_packed_detection_is_equivalent(models, packed_batch, backend):
    """Backs the choice in packed.py: without our mask, the model's own detection from the 4-row positions gives
    the same logits everywhere (so the explicit mask is a robustness choice, not a behaviour change)."""
    model = models[backend]
    kwargs = prepare_packed(packed_batch, model, backend)
    without_mask = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    with torch.no_grad():
        explicit = model(**kwargs).logits
        detected = model(**without_mask).logits
    assert (explicit - detected).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_baseline_equals_one_by_one(models, samples, processor, backend):
    model = models[backend]
    rows = [[samples[2]], [samples[1]], [samples[0]]]
    batch = hand_collate(rows, processor.pad_token_id)
    kwargs = prepare_padded(batch, model, backend)
    assert kwargs["attention_mask"].dim() == 2 and kwargs["use_cache"] is False
    with torch.no_grad():
        logits = model(**kwargs).logits
    for b, (sample,) in enumerate(rows):
        diff = (logits[b, : sample.length] - one_by_one_logits(model, sample)).abs().max().item()
        assert diff <= TOL


def test_padded_refuses_packed_rows(models, packed_batch):
    with pytest.raises(ValueError, match="more than one segment"):
        prepare_padded(packed_batch, models["sdpa"], "sdpa")


def test_kit_collator_matches_contract(packed_batch, packed_rows, processor):
    hand = hand_collate(packed_rows, processor.pad_token_id)
    for key in ("input_ids", "labels", "pack_segment_ids", "position_ids", "source_sample_num", "cu_seqlens",
                "pixel_values", "image_grid_thw", "media_segment_ids", "media_batch_index"):
        assert torch.equal(packed_batch[key], hand[key]), key
    assert packed_batch["max_seqlen"] == hand["max_seqlen"]


# ---------------------------------------------------------------------------------------------- golden M-RoPE


def test_packed_mrope_positions_golden(models):
    """Hand-made case. Row 0: [t t vs I*4 ve t] (grid 1x4x4) + [t t t] + 2 pad.
    Row 1: [t vs I*2 ve t t] (grid 1x2x4) + [vs I*2 ve] (grid 1x4x2) + 3 pad. 'vs'/'ve' are text for M-RoPE."""
    model = models["sdpa"]
    cfg = model.config
    t, vs, ve, im, pad = 100, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, 0
    row0 = [t, t, vs, im, im, im, im, ve, t] + [t, t, t] + [pad, pad]
    row1 = [t, vs, im, im, ve, t, t] + [vs, im, im, ve] + [pad, pad, pad]
    seg0 = [0] * 9 + [1] * 3 + [-1] * 2
    seg1 = [0] * 7 + [1] * 4 + [-1] * 3
    batch = {
        "input_ids": torch.tensor([row0, row1]),
        "pack_segment_ids": torch.tensor([seg0, seg1]),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 2]]),
        "media_batch_index": torch.tensor([0, 1, 1]),
        "media_segment_ids": torch.tensor([0, 0, 1]),
    }
    expected = torch.tensor([
        # text row
        [[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 0, 1],
         [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 1, 2]],
        # temporal
        [[0, 1, 2, 3, 3, 3, 3, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 2, 4, 5, 6, 0, 1, 1, 3, 0, 1, 2]],
        # height
        [[0, 1, 2, 3, 3, 4, 4, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 2, 4, 5, 6, 0, 1, 2, 3, 0, 1, 2]],
        # width
        [[0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 3, 4, 5, 6, 0, 1, 1, 3, 0, 1, 2]],
    ])
    assert torch.equal(packed_position_ids(batch, model), expected)


def test_mrope_refuses_misassigned_media(models):
    model = models["sdpa"]
    cfg = model.config
    im = cfg.image_token_id
    batch = {
        "input_ids": torch.tensor([[1, im, 1, 1, 1, 1]]),
        "pack_segment_ids": torch.tensor([[0, 0, 0, 1, 1, 1]]),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
        "media_batch_index": torch.tensor([0]),
        "media_segment_ids": torch.tensor([1]),  # the image tokens are in segment 0
    }
    with pytest.raises(ValueError, match="image tokens"):
        packed_position_ids(batch, model)


# ------------------------------------------------------------------------------------------------------ guards


def test_guard_cache(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    for bad in ({"use_cache": True}, {"use_cache": None}, {"past_key_values": object()}, {"cache": object()}):
        with pytest.raises(ValueError, match="cache"):
            check_packed_model_kwargs({**kwargs, **bad}, "sdpa", position_rows=4)


def test_guard_position_rows(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    for bad in (kwargs["position_ids"][0], kwargs["position_ids"][1:]):
        with pytest.raises(ValueError, match="position_ids"):
            check_packed_model_kwargs({**kwargs, "position_ids": bad}, "sdpa", position_rows=4)


def test_guard_2d_attention_mask(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    ones = torch.ones_like(packed_batch["input_ids"])
    with pytest.raises(ValueError, match="2-D attention_mask"):
        check_packed_model_kwargs({**kwargs, "attention_mask": ones}, "sdpa", position_rows=4)


def test_guard_batch_field_leak(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    with pytest.raises(ValueError, match="cu_seqlens"):
        check_packed_model_kwargs({**kwargs, "cu_seqlens": packed_batch["cu_seqlens"]}, "sdpa", position_rows=4)


def test_guard_backend_mismatch(models, packed_batch):
    with pytest.raises(ValueError, match="attn_implementation"):
        prepare_packed(packed_batch, models["eager"], "sdpa")


# The traps the guards exist for are real in transformers 5.24 (each would silently mix samples).


def _contaminated(model, kwargs, reference) -> bool:
    with torch.no_grad():
        return (model(**kwargs).logits - reference).abs().max().item() > 1e-3


def test_traps_are_real(models, packed_batch):
    model = models["sdpa"]
    kwargs = prepare_packed(packed_batch, model, "sdpa")
    with torch.no_grad():
        good = model(**kwargs).logits
    no_mask = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    assert _contaminated(model, {**no_mask, "use_cache": None}, good)  # eval default: a cache, packing ignored
    assert _contaminated(model, {**no_mask, "position_ids": kwargs["position_ids"][1:]}, good)  # 3-row positions
    ones = torch.ones_like(packed_batch["input_ids"])
    assert _contaminated(model, {**no_mask, "attention_mask": ones}, good)  # all-ones 2-D mask
    # the batch's cu_seqlens reach the vision tower, which takes them as its own patch boundaries
    leaked = {**kwargs, "cu_seqlens": torch.tensor([0, 8, packed_batch["pixel_values"].shape[0]], dtype=torch.int32)}
    assert _contaminated(model, leaked, good)
