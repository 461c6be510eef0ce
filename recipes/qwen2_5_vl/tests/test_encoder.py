"""The Qwen2.5-VL encoder and artifacts (the kit's ``EncoderSuite``: measure == encode on many images and clips,
assistant-only labels, errors naming the record, the encoding equal to transformers' ``Qwen2_5_VLProcessor``'s on
images, clips and text (ids, token types, pixels, grids and each clip's ``second_per_grid_ts``, which that processor
computes from the frames sampled), save/load round trip with a clip, a reproducible tokenizer asset), plus each
clip's ``second_per_grid_ts`` from the container metadata alone."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import read_video_info


class TestEncoder(EncoderSuite):
    recipe = "qwen2_5_vl"

    @classmethod
    def hf_processor(cls, encoder):
        return kit.transformers_processor(Qwen2_5_VLProcessor, encoder)

    def test_each_clip_carries_its_second_per_grid_ts_from_the_metadata_alone(self, encoder, tmp_path):
        """Clips of several containers, rates and lengths: ``encode`` writes one float32 ``second_per_grid_ts`` per
        clip, in clip order, equal to what the video processor computes from the container metadata (no decoding:
        what measure and planning see); different rates give different spacings, so the field is not a constant.
        (That it is ``Qwen2_5_VLProcessor``'s value is the suite's processor comparison.)"""
        video = encoder.video_processor
        seen = set()
        for record in kit.varied_video_records(tmp_path):
            if not record.parts("video"):
                continue
            infos = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
            seconds = encoder.encode(record).media["second_per_grid_ts"]
            assert seconds.shape == (len(infos),) and seconds.dtype == torch.float32, record.origin
            assert seconds.tolist() == pytest.approx([video.seconds_per_grid(info) for info in infos])
            seen.update(round(s, 4) for s in seconds.tolist())
        assert len(seen) >= 3
