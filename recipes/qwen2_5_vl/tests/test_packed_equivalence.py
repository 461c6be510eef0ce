"""Packed Qwen2.5-VL forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``: logits, loss and gradients
on eager, sdpa and sdpa_varlen, flash's kwargs through sdpa_varlen on CPU, LoRA, activation checkpointing, the dummy
media pass) on a pack of a clip, images and text-only samples, the windowed vision block reordering every item; plus
golden M-RoPE positions of a packed clip, whose temporal row steps by ``tokens_per_second * second_per_grid_ts``.

Everything runs on the tiny random model (``conf/model/qwen2_5_vl_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.testkit.equivalence import TOL, run_equivalence
from mvp_engine.engine.testkit.suites import EquivalenceSuite
from mvp_engine.packing.batch_metadata import PACKED_POSITIONS
from recipes.qwen import packed_position_ids
from recipes.qwen2_5_vl.packed import prepare_packed


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen2_5_vl"

    def test_the_pack_mixes_a_clip_images_and_text(self, case):
        """What the checks above run on: one row holds a text-only sample, an image sample and a clip of two
        temporal patches sampled at 10/3 frames a second (0.6 s a patch: temporal positions 0 and 2, not 0 and 4);
        four of the five images span two vision windows (2x2 merged tokens each), so the windowed block reorders
        their patches, while the clip's frames and one image fit one window each."""
        kinds = [sorted(k for k in ("image_grid_thw", "video_grid_thw") if k in s.media) for s in case.rows[1]]
        assert kinds == [[], ["image_grid_thw"], ["video_grid_thw"]]
        assert case.batch["video_grid_thw"].tolist() == [[2, 4, 4]]
        assert case.batch["second_per_grid_ts"].tolist() == pytest.approx([0.6])
        window = case.recipe.build_model(case.model_cfg, "sdpa").config.vision_config.window_size // 14
        assert (case.batch["image_grid_thw"][:, 1:] > window).any(-1).tolist() == [True, False, True, True, True]
        assert not (case.batch["video_grid_thw"][:, 1:] > window).any()

    def test_packed_positions_scale_a_clip_by_its_seconds_per_patch(self, case):
        """Hand-made row: [t t t] + [t t vs V*4 ve t] (a clip of grid 2x2x4: two temporal patches of 1x2 merged
        tokens, 0.6 s each) + 2 pad. The run starts at position 3 of its segment; temporal = 3 + int(t * 4 * 0.6)
        (tokens_per_second 4), height 3 + i, width 3 + j; then the position moves on by max(h, w) / merge = 2. Left
        out, ``second_per_grid_ts`` is 1 s a patch to the model: temporal 3 + 4t, silently."""
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        cfg = model.config
        t, vs, ve, v = 100, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
        batch = {"input_ids": torch.tensor([[t, t, t, t, t, vs, v, v, v, v, ve, t, 0, 0]]),
                 "pack_segment_ids": torch.tensor([[0] * 3 + [1] * 9 + [-1] * 2]),
                 "video_grid_thw": torch.tensor([[2, 2, 4]]), "second_per_grid_ts": torch.tensor([0.6]),
                 "video_batch_index": torch.tensor([0]), "video_segment_ids": torch.tensor([1])}
        head, tail = [0, 1, 2], [0, 1]
        expected = torch.tensor([
            [head + list(range(9)) + tail],
            [head + [0, 1, 2, 3, 3, 5, 5, 5, 6] + tail],  # temporal: 3 + int(t * 2.4)
            [head + [0, 1, 2, 3, 3, 3, 3, 5, 6] + tail],  # height
            [head + [0, 1, 2, 3, 4, 3, 4, 5, 6] + tail],  # width
        ])
        assert torch.equal(packed_position_ids(batch, model), expected)
        del batch["second_per_grid_ts"]
        expected[1, 0, 3:12] = torch.tensor([0, 1, 2, 3, 3, 7, 7, 5, 6])
        assert torch.equal(packed_position_ids(batch, model), expected)

    def test_a_pack_without_second_per_grid_ts_is_caught(self, case):
        """The negative check: the same pack with the clips' ``second_per_grid_ts`` withheld from the packed side
        (the model then assumes 1 s a patch) differs from one-by-one on the clip alone, by far more than rounding
        (measured: logits 2.8e-3, gradients 9.5e-2 relative on the tiny model)."""

        def without_seconds(batch, model, attn_implementation):  # the positions then computed here, without them
            withheld = ("second_per_grid_ts", PACKED_POSITIONS)
            return prepare_packed({k: v for k, v in batch.items() if k not in withheld}, model, attn_implementation)

        report = run_equivalence(case, "sdpa_varlen", prepare_packed=without_seconds)
        diffs = {segment.sample_id: segment.max_abs for segment in report.segments}
        assert diffs.pop("vid0") > 100 * TOL
        assert max(diffs.values()) <= TOL
        assert report.grad_rel_diff > 100 * TOL
