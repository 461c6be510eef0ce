"""The Qwen3-VL encoder and artifacts (the kit's ``EncoderSuite``: measure == encode on many images and clips,
assistant-only labels, errors naming the record, the encoding equal to transformers' ``Qwen3VLProcessor``'s on images
and text, save/load round trip with a clip, a reproducible tokenizer asset), plus the video layout: the timestamped
per-frame text ``Qwen3VLProcessor`` writes, counted exactly by ``measure`` and accepted by the model's forward."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from mvp_engine.engine.testing import collate_rows, compose_config, varied_video_records
from mvp_engine.kit.mllm.data import MLLMRecordError, read_video_info
from recipes.qwen import Qwen3SampleEncoder
from recipes.qwen.tests.encoder_suite import Qwen3EncoderSuite
from recipes.qwen3_vl.model import build_model, build_processor
from recipes.qwen3_vl.packed import prepare_packed


class TestEncoder(Qwen3EncoderSuite):
    recipe = "qwen3_vl"


@pytest.fixture(scope="module")
def processor():
    return build_processor(compose_config("qwen3_vl").model)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Clips of several containers, rates and sizes, alone, together and next to an image; ``v3`` has one frame."""
    return varied_video_records(tmp_path_factory.mktemp("clips"))


def transformers_video_text(encoder, info, grid) -> str:
    """What ``Qwen3VLProcessor.replace_video_token`` (transformers' own expansion) writes for a clip."""
    video = encoder.video_processor
    processor = SimpleNamespace(video_processor=video, vision_start_token="<|vision_start|>",
                                video_token="<|video_pad|>", vision_end_token="<|vision_end|>")
    processor._calculate_timestamps = Qwen3VLProcessor._calculate_timestamps.__get__(processor)
    metadata = VideoMetadata(info.num_frames, fps=info.fps, frames_indices=video.frame_indices(info))
    inputs = {"video_grid_thw": grid[None], "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(processor, inputs, 0)


@pytest.mark.parametrize("settings", [{}, {"fps": 8.0, "max_frames": 24, "max_pixels": 32 * 32 * 2 * 256}])
def test_clips_are_laid_out_as_transformers_measured_exactly_and_taken_by_the_model(processor, clips, settings):
    """Every clip: its text is transformers' (timestamps and per-frame runs, in place of the template's
    ``<|vision_start|><|video_pad|><|vision_end|>``), ``measure`` == ``encode`` (timestamp tokens included), and one
    packed row of all of them runs through the tiny model, which checks every clip's placeholders against its
    vision features."""
    video = dataclasses.replace(processor.video_processor, **settings)
    encoder = Qwen3SampleEncoder(dataclasses.replace(processor, video_processor=video))
    samples = []
    for record in clips:
        if record.record_id == "v3":  # one frame: refused, as transformers refuses it
            continue
        sample = encoder.encode(record)
        assert encoder.measure(record) == sample.meta, record.origin
        text = encoder.tokenizer.decode(sample.input_ids)
        infos = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
        for info, grid in zip(infos, sample.media["video_grid_thw"]):
            assert transformers_video_text(encoder, info, grid) in text
        assert text.count(" seconds><|vision_start|>") == int(sample.media["video_grid_thw"][:, 0].sum())
        assert "<|vision_start|><|vision_start|>" not in text and "<|vision_end|><|vision_end|>" not in text
        samples.append(sample)
    model = build_model(compose_config("qwen3_vl").model, "sdpa").eval()
    with torch.no_grad():
        logits = model(**prepare_packed(collate_rows([samples], processor.pad_token_id), model, "sdpa")).logits
    assert torch.isfinite(logits).all()


def test_a_clip_of_one_frame_is_the_same_bad_record_to_measure_and_encode(processor, clips):
    encoder = Qwen3SampleEncoder(processor)
    for call in (encoder.measure, encoder.encode):
        with pytest.raises(MLLMRecordError, match="videos.jsonl:3") as err:
            call(clips[3])
        assert err.value.reason == "video_rejected"
