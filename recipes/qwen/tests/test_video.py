"""The Qwen families' video processors against transformers' own code: Qwen2-VL's and Qwen3-VL's frame sampling, sizes,
timestamps and patch layout (the kit's ``patchify``), a still clip against the image processor, settings round trips."""

from __future__ import annotations

import importlib
import json
import math
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mvp_engine.engine.testing import write_image
from mvp_engine.kit.mllm.data import VideoInfo, patchify, read_video_info
from recipes.qwen import Qwen3VideoProcessor, QwenVideoProcessor

# ------------------------------------------------------------------------------- transformers' own code as reference


@pytest.fixture(scope="module")
def qwen2_vl_video_processor_class():
    """transformers' ``Qwen2VLVideoProcessor``, imported with a stub torchvision (its sampling and ``patchify`` use
    torch only); the stub and the module leave ``sys.modules`` afterwards."""
    import transformers.video_processing_utils  # noqa: F401  (imported for real before the stub exists)

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    module_name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    with pytest.MonkeyPatch.context() as patch:
        for name in names:
            patch.setitem(sys.modules, name, types.ModuleType(name))
        patch.delitem(sys.modules, module_name, raising=False)
        yield importlib.import_module(module_name).Qwen2VLVideoProcessor
        sys.modules.pop(module_name, None)


SAMPLING = [  # frames, source fps, fps, min_frames, max_frames
    (100, 30.0, 2.0, 4, 768), (7, 4.0, 2.0, 4, 16), (300, 29.97, 2.0, 4, 16), (11, 2.0, 2.0, 4, 16),
    (2, 25.0, 2.0, 4, 768), (1000, 24.0, 0.5, 4, 768), (61, 30.0, 1.0, 8, 12), (5, 1.0, 3.0, 4, 768),
]


@pytest.mark.parametrize("frames, source_fps, fps, min_frames, max_frames", SAMPLING)
def test_frame_sampling_is_transformers(qwen2_vl_video_processor_class, frames, source_fps, fps, min_frames,
                                        max_frames):
    from transformers.video_utils import VideoMetadata

    processor = QwenVideoProcessor(fps=fps, min_frames=min_frames, max_frames=max_frames)
    settings = SimpleNamespace(num_frames=None, fps=fps, temporal_patch_size=2, min_frames=min_frames,
                               max_frames=max_frames)
    reference = qwen2_vl_video_processor_class.sample_frames(settings, VideoMetadata(frames, fps=source_fps))
    ours = processor.frame_indices(VideoInfo("v", frames, source_fps, 64, 64))
    assert ours == reference.tolist()


def test_a_clip_shorter_than_a_temporal_patch_is_taken_whole():
    assert QwenVideoProcessor().frame_indices(VideoInfo("v", 1, 30.0, 64, 64)) == [0]


@pytest.mark.parametrize("frames", [2, 5])
def test_patch_layout_is_transformers(qwen2_vl_video_processor_class, frames):
    video = torch.randn(1, frames, 3, 56, 84)
    reference, t, h, w = qwen2_vl_video_processor_class.patchify(None, video, 14, 2, 2)
    ours = patchify(video[0].numpy(), 14, 2, 2)
    assert np.array_equal(ours, reference[0].numpy()) and (t, h, w) == (-(-frames // 2), 4, 6)


def test_a_still_clip_gives_the_image_processors_pixels(tmp_path):
    """Two identical frames are what the image processor makes of one image (it repeats it in time): the same
    grid and, with the same PIL resize, the same values."""
    picture = write_image(tmp_path / "picture.png", 45, 70, seed=3)
    folder = tmp_path / "still"
    folder.mkdir()
    for name in ("1.png", "2.png"):
        Image.open(picture).save(folder / name)
    pixels = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    media, counts = QwenVideoProcessor(**pixels)([read_video_info(folder)])
    image = Qwen2VLImageProcessorPil(**pixels)(images=[Image.open(picture).convert("RGB")], return_tensors="pt")
    assert media["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    assert counts == [int(image["image_grid_thw"].prod()) // 4]
    assert (media["pixel_values_videos"] - image["pixel_values"]).abs().max() <= 1e-5


def test_settings_are_validated_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="max_frames=0"):
        QwenVideoProcessor(max_frames=0)
    with pytest.raises(ValueError, match="inverted"):
        QwenVideoProcessor(min_pixels=10_000, max_pixels=100)
    with pytest.raises(ValueError, match="max_frames=1 is invalid: allowed at least temporal_patch_size=2"):
        QwenVideoProcessor(min_frames=1, max_frames=1)
    processor = QwenVideoProcessor(min_pixels=3136, max_pixels=12544, fps=1.5, max_frames=16)
    processor.save_pretrained(tmp_path)
    assert QwenVideoProcessor.from_pretrained(tmp_path) == processor
    assert QwenVideoProcessor.from_pretrained(tmp_path / "absent", fps=3.0) == QwenVideoProcessor(fps=3.0)


# ----------------------------------------------------------------------- Qwen3-VL / Qwen3.5: Qwen3VideoProcessor


def qwen3_reference(processor: Qwen3VideoProcessor):
    """transformers' ``Qwen3VLVideoProcessor`` with the same settings (it imports and runs its sampling, sizing and
    ``patchify`` without torchvision; only its resize needs it)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(fps=processor.fps, min_frames=processor.min_frames, max_frames=processor.max_frames,
                                 size={"shortest_edge": processor.min_pixels, "longest_edge": processor.max_pixels})


QWEN3_CLIPS = [  # frames, source fps, fps, min_frames, max_frames, height, width
    (100, 30.0, 2.0, 4, 768, 48, 64), (7, 4.0, 2.0, 4, 16, 90, 40), (300, 29.97, 2.0, 4, 16, 360, 640),
    (11, 2.0, 2.0, 4, 16, 30, 50), (3, 25.0, 2.0, 4, 768, 20, 300), (1000, 24.0, 0.5, 4, 768, 1080, 1920),
    (61, 30.0, 1.0, 8, 12, 64, 64), (5, 1.0, 3.0, 4, 768, 100, 20),
]


@pytest.mark.parametrize("frames, source_fps, fps, min_frames, max_frames, height, width", QWEN3_CLIPS)
def test_qwen3_sampling_grid_and_timestamps_are_transformers(frames, source_fps, fps, min_frames, max_frames, height,
                                                              width):
    """Frame indices (``sample_frames``), patch count (``get_num_of_video_patches``) and the text's timestamps
    (``Qwen3VLProcessor._calculate_timestamps``) as transformers computes them, from metadata alone."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    ours = Qwen3VideoProcessor(min_pixels=32 * 32 * 8, max_pixels=32 * 32 * 2 * 64, fps=fps, min_frames=min_frames,
                               max_frames=max_frames)
    reference = qwen3_reference(ours)
    info = VideoInfo("v", frames, source_fps, width, height)
    indices = reference.sample_frames(VideoMetadata(frames, fps=source_fps)).tolist()
    assert ours.frame_indices(info) == indices
    assert math.prod(ours.grid_thw(info)) == reference.get_num_of_video_patches(len(indices), height, width)
    assert ours.timestamps(info) == Qwen3VLProcessor._calculate_timestamps(None, indices, source_fps, 2)


def test_qwen3_refuses_a_clip_of_one_sampled_frame_as_transformers_does():
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        Qwen3VideoProcessor().token_count(VideoInfo("v", 1, 30.0, 64, 64))


@pytest.mark.parametrize("frames", [2, 5])
def test_qwen3_patch_layout_is_transformers(frames):
    video = torch.randn(1, frames, 3, 64, 96)
    reference, t, h, w = qwen3_reference(Qwen3VideoProcessor()).patchify(video, 16, 2, 2)
    assert np.array_equal(patchify(video[0].numpy(), 16, 2, 2), reference[0].numpy())
    assert (t, h, w) == (-(-frames // 2), 4, 6)


def test_qwen3_settings_round_trip_under_their_own_type(tmp_path):
    processor = Qwen3VideoProcessor(min_pixels=8192, max_pixels=131072, fps=1.5, max_frames=16)
    processor.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "video_preprocessor_config.json").read_text())["video_processor_type"] == \
        "Qwen3VLVideoProcessor"
    assert Qwen3VideoProcessor.from_pretrained(tmp_path) == processor
