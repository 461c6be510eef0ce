"""The GLM-4.1V encoder and artifacts (the kit's ``EncoderSuite``: measure == encode on many images and clips,
assistant-only labels, errors naming the record, save/load round trip with a clip, a reproducible tokenizer asset, no
torchvision), plus the comparison with transformers' own ``Glm4vProcessor`` on the same conversations (ids,
``mm_token_type_ids``, pixels and grids identical), and the clips: the frames ``Glm4vVideoProcessor`` samples, its
grid, and the per-frame text with timestamps ``Glm4vProcessor`` writes, typed as video, measured exactly."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor as TransformersVideoProcessor
from transformers.video_utils import VideoMetadata

from mvp_engine.engine.testing import compose_config, demo_like_records, varied_video_records
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import read_video_info
from mvp_engine.kit.mllm.data.images import load_image
from recipes.glm4v import Glm4vSampleEncoder, build_processor


class TestEncoder(EncoderSuite):
    recipe = "glm4v"


class ImageOnlyProcessor(Glm4vProcessor):
    """``Glm4vProcessor`` without its video processor (transformers' processors refuse one without torchvision);
    everything it does for text and images is transformers' own."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


@pytest.fixture(scope="module")
def glm_encoder():
    return Glm4vSampleEncoder(build_processor(compose_config("glm4v").model))


@pytest.fixture(scope="module")
def transformers_processor(glm_encoder):
    return ImageOnlyProcessor(image_processor=glm_encoder.image_processor, tokenizer=glm_encoder.tokenizer,
                              video_processor=None, chat_template=glm_encoder.tokenizer.chat_template)


def test_encoding_equals_transformers_glm4v_processor(glm_encoder, transformers_processor, tmp_path):
    """On the chat template's text of each record (one image, three images with a system turn, text-only),
    ``Glm4vProcessor`` over the same tokenizer and image processor gives our ids, token types, pixels and grids."""
    records = demo_like_records(tmp_path)
    assert {len(r.image_paths) for r in records} == {0, 1, 3}
    for record in records:
        ours = glm_encoder.encode(record)
        images = [load_image(path) for path in record.image_paths]
        text = transformers_processor.apply_chat_template(record.messages, tokenize=False)
        theirs = transformers_processor(text=[text], images=[images] if images else None, return_tensors="pt")
        assert torch.equal(theirs["input_ids"][0], ours.input_ids), record.origin
        assert torch.equal(theirs["mm_token_type_ids"][0], ours.token_fields["mm_token_type_ids"]), record.origin
        if images:
            assert torch.equal(theirs["pixel_values"], ours.media["pixel_values"]), record.origin
            assert torch.equal(theirs["image_grid_thw"], ours.media["image_grid_thw"]), record.origin
            assert 16 <= int(ours.media["image_grid_thw"].prod(-1).min()) // 4
            assert int(ours.media["image_grid_thw"].prod(-1).max()) // 4 <= 64


def transformers_video_text(processor, video, info, grid) -> str:
    """What ``Glm4vProcessor.replace_video_token`` writes for a clip of ``grid`` sampled at ``video``'s indices."""
    namespace = SimpleNamespace(video_processor=SimpleNamespace(merge_size=video.merge_size),
                                replace_frame_token_id=processor.replace_frame_token_id)
    metadata = VideoMetadata(info.num_frames, fps=info.fps, frames_indices=video.frame_indices(info))
    inputs = {"video_grid_thw": grid[None], "video_metadata": [metadata]}
    return Glm4vProcessor.replace_video_token(namespace, inputs, 0)


@pytest.mark.parametrize("settings", [{}, {"fps": 5.0, "max_pixels": 28 * 28 * 2 * 128}])
def test_clips_sample_lay_out_and_type_as_transformers(glm_encoder, transformers_processor, tmp_path, settings):
    """Every clip (several containers, rates, sizes; alone, together, beside an image): the frame indices are
    ``Glm4vVideoProcessor.sample_frames``'s, the grid its ``get_num_of_video_patches``', the text in place of
    ``<|video|>`` is ``Glm4vProcessor.replace_video_token``'s (a run and its whole seconds per temporal patch), the
    token types ``create_mm_token_type_ids``' (frames are video, images beside them image), measure == encode."""
    video = dataclasses.replace(glm_encoder.video_processor, **settings)
    encoder = Glm4vSampleEncoder(dataclasses.replace(glm_encoder.processor, video_processor=video))
    reference = TransformersVideoProcessor(fps=video.fps, size={"shortest_edge": video.min_pixels,
                                                                "longest_edge": video.max_pixels},
                                           patch_size=video.patch_size)
    clips = 0
    for record in varied_video_records(tmp_path):
        sample = encoder.encode(record)
        assert encoder.measure(record) == sample.meta, record.origin
        text = encoder.tokenizer.decode(sample.input_ids)
        infos = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
        for info, grid in zip(infos, sample.media.get("video_grid_thw", [])):
            metadata = VideoMetadata(info.num_frames, fps=info.fps, duration=info.num_frames / info.fps)
            assert video.frame_indices(info) == reference.sample_frames(metadata).tolist(), record.origin
            patches = reference.get_num_of_video_patches(len(video.frame_indices(info)), info.height, info.width)
            assert int(grid.prod()) == patches, record.origin
            assert f"<|begin_of_video|>{transformers_video_text(transformers_processor, video, info, grid)}" \
                   "<|end_of_video|>" in text, record.origin
            clips += 1
        types = transformers_processor.create_mm_token_type_ids([sample.input_ids.tolist()])[0]
        assert sample.token_fields["mm_token_type_ids"].tolist() == types, record.origin
        assert int((sample.token_fields["mm_token_type_ids"] == 2).sum()) == sum(
            int(g.prod()) // 4 for g in sample.media.get("video_grid_thw", [])), record.origin
    assert clips >= 4
