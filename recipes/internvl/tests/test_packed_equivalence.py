"""Packed InternVL forwards/backwards equal one-by-one ones (the kit's ``EquivalenceSuite``: logits, loss and
gradients on eager, sdpa and sdpa_varlen, flex_attention forward-only on CPU, flash's kwargs through a CPU varlen
reference), on packs holding a three-image sample of 1 + 3 + 1 tiles, single-image samples and text-only samples;
plus the checks that the tiles of a pack are the images' in segment order, and InternVL 3.5's Qwen3 language model."""

import dataclasses

import pytest

from mvp_engine.engine.testing import compose_config, run_equivalence
from mvp_engine.engine.testkit.suites import EquivalenceSuite
from recipes.internvl.packed import prepare_packed

QWEN3 = ["model.config.text_config.model_type=qwen3", "+model.config.text_config.head_dim=16"]


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "internvl"

    def test_the_packs_hold_multi_tile_images_in_segment_order(self, case):
        """What the checks above run on: tiles of every image of every sample stacked in segment order, one owner
        per image (not per tile)."""
        assert [s.num_media for s in case.samples] == [1, 0, 3, 0, 1]
        tiles = case.batch["image_num_patches"].tolist()
        assert tiles == [3, 1, 3, 1, 1] and case.batch["pixel_values"].shape[0] == sum(tiles)
        owners = list(zip(case.batch["media_batch_index"].tolist(), case.batch["media_segment_ids"].tolist()))
        assert len(owners) == len(tiles) and owners == sorted(owners)

    def test_tiles_not_matching_their_counts_are_refused(self, case):
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        batch = dict(case.batch, pixel_values=case.batch["pixel_values"][1:])
        with pytest.raises(ValueError, match="image_num_patches"):
            prepare_packed(batch, model, "sdpa")
        batch = dict(case.batch, image_num_patches=case.batch["image_num_patches"].flip(0))
        with pytest.raises(ValueError, match="image tokens but its"):
            prepare_packed(batch, model, "sdpa")

    def test_a_qwen3_language_model_internvl3_5_packs_exactly_too(self, case):
        """InternVL 3.5 pairs the same tower with Qwen3 (q/k norms, explicit head_dim): packed == one-by-one on the
        default packed backend, logits, loss and gradients."""
        qwen3 = dataclasses.replace(case, model_cfg=compose_config("internvl", QWEN3).model)
        model = qwen3.recipe.build_model(qwen3.model_cfg, "sdpa")
        assert type(model.model.language_model).__name__ == "Qwen3Model"
        report = run_equivalence(qwen3, "sdpa_varlen")
        print("\n".join(report.lines()))
        report.check()
