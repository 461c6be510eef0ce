"""Packed GLM-4.1V forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``: logits, loss and gradients on
eager, sdpa and sdpa_varlen, flash on GPU and its kwargs through sdpa_varlen on CPU, LoRA, activation checkpointing,
the dummy media pass) on a pack of a timestamped clip, an image and a text-only sample beside a pack of images and
text; plus what is GLM-4.1V's own: golden per-frame positions of a packed clip, the recipe's model class giving
transformers' own ``Glm4vForConditionalGeneration`` logits wherever that one runs, transformers' own failing on a
pack that holds an image and a clip, and a batch without ``mm_token_type_ids`` refused.

Everything runs on the tiny random model (``conf/model/glm4v_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4vForConditionalGeneration

from mvp_engine.engine.testing import collate_rows
from mvp_engine.engine.testkit.suites import EquivalenceSuite
from recipes.glm4v.packed import packed_position_ids, prepare_packed, prepare_padded


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "glm4v"

    def test_the_pack_mixes_a_clip_an_image_and_text(self, case):
        """What the checks above run on: one row holds a text-only sample, an image sample and a clip of several
        timestamped frames, whose features must land on the clip's tokens, not on the image's beside them."""
        kinds = [sorted(k for k in ("image_grid_thw", "video_grid_thw") if k in s.media) for s in case.rows[1]]
        assert kinds == [[], ["image_grid_thw"], ["video_grid_thw"]]
        frames = int(case.batch["video_grid_thw"][0, 0])
        assert frames >= 2
        types = case.batch["mm_token_type_ids"][1]
        assert int((types == 2).sum()) == int(case.batch["video_grid_thw"].prod(-1).sum()) // 4
        assert (types == 1).any()

    def test_packed_positions_split_a_clip_per_frame(self, case):
        """Hand-made row: [t t t] + [t t bv bi I*4 ei 0 bi I*4 ei 1 ev t] (a clip of grid 2x4x4: two frame runs of
        2x2 merged tokens, each followed by its seconds) + 2 pad. Every run starts temporal, height and width at the
        current position (GLM-4.1V's temporal row does not advance inside a clip) and moves it on by
        max(h, w) / merge = 2; the timestamps are text; the second segment starts at 0."""
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        t, i = 100, model.config.image_token_id
        ids = [t] * 3 + [t, t, t, t] + [i] * 4 + [t, t, t] + [i] * 4 + [t, t, t, t] + [0, 0]
        types = [0] * 7 + [2] * 4 + [0] * 3 + [2] * 4 + [0] * 6
        batch = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types]),
                 "pack_segment_ids": torch.tensor([[0] * 3 + [1] * 19 + [-1] * 2]),
                 "video_grid_thw": torch.tensor([[2, 4, 4]]),
                 "video_batch_index": torch.tensor([0]), "video_segment_ids": torch.tensor([1])}
        head, tail = [0, 1, 2], [0, 1]
        text = list(range(19))
        expected = torch.tensor([
            [head + text + tail],
            [head + [0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 9, 9, 9, 11, 12, 13, 14] + tail],  # temporal
            [head + [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 9, 10, 10, 11, 12, 13, 14] + tail],  # height
            [head + [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 9, 10, 11, 12, 13, 14] + tail],  # width
        ])
        assert torch.equal(packed_position_ids(batch, model), expected)

    def test_the_recipe_model_is_transformers_glm4v_wherever_that_runs(self, case):
        """Sample by sample (an image, three images, a clip, text): transformers' own model with the same weights,
        fed the processor's ids (frames as image placeholders) and ``mm_token_type_ids``, gives the recipe model's
        padded logits exactly; on the packed row of an image and a clip it refuses (its image count includes the
        frames), which the recipe's model class is there for."""
        ours = case.recipe.build_model(case.model_cfg, "sdpa").eval()
        theirs = Glm4vForConditionalGeneration(ours.config).eval()
        theirs.load_state_dict(ours.state_dict())
        pad = case.recipe.pad_token_id(case.processor)
        with torch.no_grad():
            for sample in case.samples:
                batch = collate_rows([[sample]], pad)
                kwargs = prepare_padded(batch, ours, "sdpa")
                expected = ours(**kwargs).logits
                native = theirs(**{**kwargs, "input_ids": batch["input_ids"]}).logits
                assert torch.equal(native, expected), sample.sample_id
            mixed = collate_rows([case.rows[1]], pad)
            kwargs = prepare_packed(mixed, ours, "sdpa")
            assert torch.isfinite(ours(**kwargs).logits).all()
            with pytest.raises(ValueError, match="Image features and image tokens do not match"):
                theirs(**{**kwargs, "input_ids": mixed["input_ids"]})

    def test_a_batch_without_mm_token_type_ids_is_refused(self, case):
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        batch = {k: v for k, v in case.batch.items() if k != "mm_token_type_ids"}
        for prepare in (prepare_packed, prepare_padded):
            with pytest.raises(ValueError, match="no 'mm_token_type_ids'.*reuse the image placeholder"):
                prepare(batch, model, "sdpa")
