"""Packed Qwen3-VL forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``: logits, loss and gradients on
eager, sdpa and sdpa_varlen, flash on GPU and its kwargs through sdpa_varlen on CPU, the DeepStack mergers reached
by the dummy media pass) on a pack of a timestamped clip, images and text-only samples; plus golden per-frame M-RoPE
positions of a packed clip.

Everything runs on the tiny random model (``conf/model/qwen3_vl_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import torch

from mvp_engine.engine.testkit.suites import EquivalenceSuite
from recipes.qwen import packed_position_ids


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen3_vl"

    def test_the_pack_mixes_a_clip_images_and_text(self, case):
        """What the checks above run on: one row holds a text-only sample, an image sample and a two-frame clip,
        whose final and DeepStack features must land on the clip's tokens, not on the image's next to them."""
        kinds = [sorted(k for k in ("image_grid_thw", "video_grid_thw") if k in s.media) for s in case.rows[1]]
        assert kinds == [[], ["image_grid_thw"], ["video_grid_thw"]]
        assert case.batch["video_grid_thw"].tolist() == [[2, 4, 4]]

    def test_packed_positions_split_a_clip_per_frame(self, case):
        """Hand-made row: [t t t] + [t t vs V*4 ve ts vs V*4 ve t] (a clip of grid 2x4x4: two frame runs of 2x2
        merged tokens) + 2 pad. Each run starts temporal, height and width at the current position and moves it on
        by max(h, w) / merge = 2; the timestamp between the runs is text; the second segment starts at 0."""
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        cfg = model.config
        t, vs, ve, v = 100, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
        batch = {"input_ids": torch.tensor([[t, t, t, t, t, vs, v, v, v, v, ve, t, vs, v, v, v, v, ve, t, 0, 0]]),
                 "pack_segment_ids": torch.tensor([[0] * 3 + [1] * 16 + [-1] * 2]),
                 "video_grid_thw": torch.tensor([[2, 4, 4]]),
                 "video_batch_index": torch.tensor([0]), "video_segment_ids": torch.tensor([1])}
        head, tail = [0, 1, 2], [0, 1]
        expected = torch.tensor([
            [head + list(range(16)) + tail],
            [head + [0, 1, 2, 3, 3, 3, 3, 5, 6, 7, 8, 8, 8, 8, 10, 11] + tail],  # temporal
            [head + [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 9, 10, 11] + tail],  # height
            [head + [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9, 8, 9, 10, 11] + tail],  # width
        ])
        assert torch.equal(packed_position_ids(batch, model), expected)
