"""The GLM-4.1V encoder and artifacts (the kit's ``EncoderSuite``: measure == encode on many images and clips,
assistant-only labels, errors naming the record, the encoding equal to transformers' ``Glm4vProcessor``'s on images,
clips and text (ids, ``mm_token_type_ids``, pixels, grids; each clip's per-frame runs with their timestamps),
save/load round trip with a clip, a reproducible tokenizer asset), plus the image token range and the clips under
other video settings: the frames ``Glm4vVideoProcessor`` samples, its grid, and the processor comparison again."""

from __future__ import annotations

import dataclasses

import pytest
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor as TransformersVideoProcessor
from transformers.video_utils import VideoMetadata

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import read_video_info
from recipes.glm4v import Glm4vSampleEncoder


class TestEncoder(EncoderSuite):
    recipe = "glm4v"

    @classmethod
    def hf_processor(cls, encoder):
        return kit.transformers_processor(Glm4vProcessor, encoder)

    def test_every_image_is_16_to_64_merged_tokens(self, encoder, tmp_path):
        for record in kit.demo_like_records(tmp_path):
            if record.image_paths:
                tokens = encoder.encode(record).media["image_grid_thw"].prod(-1) // 4
                assert 16 <= int(tokens.min()) and int(tokens.max()) <= 64, record.origin

    @pytest.mark.parametrize("settings", [{}, {"fps": 5.0, "max_pixels": 28 * 28 * 2 * 128}])
    def test_clips_sample_lay_out_and_type_as_transformers(self, encoder, tmp_path, settings):
        """Every clip (several containers, rates, sizes; alone, together, beside an image), under the default video
        settings and another rate and size: the frame indices are ``Glm4vVideoProcessor.sample_frames``'s, the grid
        its ``get_num_of_video_patches``', measure == encode, the encoding ``Glm4vProcessor``'s (a run and its whole
        seconds per temporal patch, frames typed as video, images beside them as image), the video-typed tokens
        exactly the clips' merged patches."""
        video = dataclasses.replace(encoder.video_processor, **settings)
        variant = Glm4vSampleEncoder(dataclasses.replace(encoder.processor, video_processor=video))
        reference = TransformersVideoProcessor(fps=video.fps, size={"shortest_edge": video.min_pixels,
                                                                    "longest_edge": video.max_pixels},
                                               patch_size=video.patch_size)
        records = [record for record in kit.varied_video_records(tmp_path) if record.parts("video")]
        clips = 0
        for record in records:
            sample = variant.encode(record)
            assert variant.measure(record) == sample.meta, record.origin
            infos = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
            for info, grid in zip(infos, sample.media["video_grid_thw"], strict=True):
                metadata = VideoMetadata(info.num_frames, fps=info.fps, duration=info.num_frames / info.fps)
                assert video.frame_indices(info) == reference.sample_frames(metadata).tolist(), record.origin
                patches = reference.get_num_of_video_patches(len(video.frame_indices(info)), info.height, info.width)
                assert int(grid.prod()) == patches, record.origin
                clips += 1
            assert int((sample.token_fields["mm_token_type_ids"] == 2).sum()) == sum(
                int(g.prod()) // 4 for g in sample.media["video_grid_thw"]), record.origin
        assert clips >= 4
        kit.check_encoder_matches_processor(variant, self.hf_processor(variant), records)
