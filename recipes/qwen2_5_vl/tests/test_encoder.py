"""The Qwen2.5-VL encoder and artifacts (the kit's ``EncoderSuite``: measure == encode on many images and clips,
assistant-only labels, errors naming the record, save/load round trip with a clip, a reproducible tokenizer asset, no
torchvision), plus the comparison with transformers' own ``Qwen2_5_VLProcessor`` on the same conversations (ids,
token types, pixels and grids identical) and each clip's ``second_per_grid_ts`` as that processor computes it, from
the container metadata alone."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLProcessor
from transformers.video_utils import VideoMetadata

from mvp_engine.engine.testing import compose_config, demo_like_records, varied_video_records
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import read_video_info
from mvp_engine.kit.mllm.data.images import load_image
from recipes.qwen2_5_vl import Qwen25VLSampleEncoder, build_processor


class TestEncoder(EncoderSuite):
    recipe = "qwen2_5_vl"


class ImageOnlyProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without its video processor (transformers' needs torchvision, which does not install
    beside this torch); everything it does for text and images is transformers' own."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


@pytest.fixture(scope="module")
def qwen_encoder():
    return Qwen25VLSampleEncoder(build_processor(compose_config("qwen2_5_vl").model))


def test_encoding_equals_transformers_qwen2_5_vl_processor(qwen_encoder, tmp_path):
    """On the chat template's text of each record (one image, three images with a system turn, text-only), the
    family's processor over the same tokenizer and image processor gives our ids, modality map, pixels and grids."""
    processor = ImageOnlyProcessor(image_processor=qwen_encoder.image_processor, tokenizer=qwen_encoder.tokenizer,
                                   video_processor=None, chat_template=qwen_encoder.tokenizer.chat_template)
    records = demo_like_records(tmp_path)
    assert {len(r.image_paths) for r in records} == {0, 1, 3}
    for record in records:
        ours = qwen_encoder.encode(record)
        images = [load_image(path) for path in record.image_paths]
        text = processor.apply_chat_template(record.messages, tokenize=False)
        theirs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        assert torch.equal(theirs["input_ids"][0], ours.input_ids), record.origin
        types = (ours.input_ids == qwen_encoder.image_token_id).int()
        assert torch.equal(theirs["mm_token_type_ids"][0].int(), types), record.origin
        if images:
            assert torch.equal(theirs["pixel_values"], ours.media["pixel_values"]), record.origin
            assert torch.equal(theirs["image_grid_thw"], ours.media["image_grid_thw"]), record.origin


def test_each_clip_carries_the_second_per_grid_ts_transformers_computes(qwen_encoder, tmp_path):
    """Clips of several containers, rates and lengths: ``encode`` writes one ``second_per_grid_ts`` per clip, in
    clip order, equal to ``Qwen2_5_VLProcessor``'s ``temporal_patch_size / VideoMetadata.sampled_fps`` for the
    frames the video processor samples, and to what the metadata alone gives (no decoding)."""
    video = qwen_encoder.video_processor
    seen = set()
    for record in varied_video_records(tmp_path):
        if not record.parts("video"):
            continue
        sample = qwen_encoder.encode(record)
        infos = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
        expected = [video.temporal_patch_size
                    / VideoMetadata(info.num_frames, fps=info.fps, frames_indices=video.frame_indices(info)).sampled_fps
                    for info in infos]
        seconds = sample.media["second_per_grid_ts"]
        assert seconds.shape == (len(infos),) and seconds.dtype == torch.float32, record.origin
        assert torch.equal(seconds, torch.tensor(expected, dtype=torch.float32)), record.origin
        assert seconds.tolist() == pytest.approx([video.seconds_per_grid(info) for info in infos])
        seen.update(round(s, 4) for s in seconds.tolist())
    assert len(seen) >= 3  # different rates give different spacings: the field is not a constant
