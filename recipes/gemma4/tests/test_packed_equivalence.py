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
