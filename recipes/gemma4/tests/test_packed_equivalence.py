"""Packed Gemma 4 forwards/backwards equal one-by-one ones (the kit's ``EquivalenceSuite``: logits, loss and
gradients on eager, sdpa and sdpa_varlen with per-span masks, flex_attention forward-only on CPU), where the
one-by-one reference is the model's own unpacked forward with ``mm_token_type_ids``; the packs hold a three-image
sample, text-only samples and samples the 24-token sliding window cuts inside (images included), with images of
different sizes (different soft-token counts, padded patches). Plus what is Gemma 4's own: its images are blocks in
the sliding layers only, the pack's pre-patchified images and positions are the samples' own in order, and a batch
without ``mm_token_type_ids`` is refused."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.testkit.suites import EquivalenceSuite
from mvp_engine.packing import dense_mask
from recipes.gemma4.packed import prepare_packed


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "gemma4"

    def test_the_packs_cross_the_window_inside_images_and_samples(self, case):
        window = case.recipe.build_model(case.model_cfg, "sdpa").config.text_config.sliding_window
        tokens = [int(n) for s in case.samples if s.num_media
                  for n in ((s.media["image_position_ids"] != -1).all(-1).sum(-1) // 4)]
        assert [s.num_media for s in case.samples] == [1, 0, 3, 0, 1]
        assert min(tokens) > window  # the window cuts inside every image, so inside every image sample
        assert any(s.length > window for s in case.samples if not s.num_media)  # and inside a text-only one
        assert len(set(tokens)) > 1, "images of different soft-token counts"
        assert int((case.batch["mm_token_type_ids"] == 1).sum()) == sum(tokens)

    def test_pixel_values_and_positions_are_merged_per_pack_in_sample_order(self, case):
        merged = torch.cat([s.media["image_position_ids"] for s in case.samples if s.num_media])
        assert torch.equal(case.batch["image_position_ids"], merged)
        assert torch.equal(case.batch["pixel_values"], torch.cat([s.media["pixel_values"] for s in case.samples
                                                                  if s.num_media]))

    def test_images_are_bidirectional_in_the_sliding_layers_only(self, case):
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        masks = prepare_packed(case.batch, model, "sdpa")["attention_mask"]
        image = case.batch["mm_token_type_ids"] == 1
        row, first = (int(i) for i in image.nonzero()[0])
        upper = (row, 0, first, slice(first + 1, first + 4))  # an image token and the next three of its image
        assert not masks["full_attention"][upper].any()
        assert masks["sliding_attention"][upper].all()
        causal = dense_mask(case.batch["pack_segment_ids"])
        assert torch.equal(masks["full_attention"], causal)

    def test_a_batch_without_mm_token_type_ids_is_refused(self, case):
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        batch = {k: v for k, v in case.batch.items() if k != "mm_token_type_ids"}
        for prepare in (prepare_packed, case.recipe.prepare_padded):
            with pytest.raises(ValueError, match="no 'mm_token_type_ids'.*silently drops"):
                prepare(batch, model, "sdpa")


def test_transformers_own_packed_gemma4_path_differs_from_one_by_one(tmp_path):
    """The trap the recipe's masks avoid, on Gemma 4 (transformers 5.24): with packed ``position_ids``, the token
    types and no mask, ``create_causal_mask`` re-indexes the sliding layers' image-block overlay by per-segment
    positions, so a row's later samples with images come out wrong while its first samples stay exact. The day a
    transformers release fixes it this test fails, and the recipe's own masks can be reconsidered."""
    from mvp_engine.engine.testing import equivalence_case
    from mvp_engine.packing import text_positions

    case = equivalence_case("gemma4", tmp_path)
    model = case.recipe.build_model(case.model_cfg, "sdpa").eval()
    batch = case.batch
    with torch.no_grad():
        theirs = model(input_ids=batch["input_ids"], position_ids=text_positions(batch), use_cache=False,
                       mm_token_type_ids=batch["mm_token_type_ids"], pixel_values=batch["pixel_values"],
                       image_position_ids=batch["image_position_ids"]).logits
        ours = model(**prepare_packed(batch, model, "sdpa")).logits
        diffs = []
        for row, start, end, sample in case.segments():
            alone = model(**case.recipe.prepare_padded(case.alone(sample), model, "sdpa")).logits[0]
            diffs.append((start, sample.num_media, (theirs[row, start:end] - alone).abs().max().item(),
                          (ours[row, start:end] - alone).abs().max().item()))
    print("\n".join(f"segment at {start:>3} ({media} images): transformers' packed path {theirs:.3e}, ours {ours:.3e}"
                    for start, media, theirs, ours in diffs))
    assert all(ours <= 1e-5 for *_, ours in diffs)
    assert all(theirs <= 1e-5 for start, _, theirs, _ in diffs if start == 0)
    later_images = [theirs for start, media, theirs, _ in diffs if start > 0 and media]
    assert later_images and min(later_images) > 1e-3, diffs
