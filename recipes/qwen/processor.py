"""The Qwen families' processor bundle: tokenizer + ``Qwen2VLImageProcessorPil`` (transformers' torchvision-free image
processor, which every Qwen family uses with its own patch size, mean and std) + the family's numpy/PIL video
processor (``QwenVideoProcessor`` for Qwen2-VL, ``Qwen3VideoProcessor`` for Qwen3-VL / Qwen3.5), whose patch sizes,
mean and std are taken from the image processor so images and videos meet the tower alike."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mvp_engine.engine.builders import ProcessorBundle, build_processor_bundle, grid_video_processor, to_plain

from .tokens import IMAGE_TOKEN
from .video import QwenVideoProcessor

VIDEO_SETTINGS = ("min_pixels", "max_pixels", "fps", "min_frames", "max_frames")  # model.video_<key>


@dataclass
class QwenProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Qwen2VLImageProcessorPil`` + the family's video processor; placeholders ``<|image_pad|>`` and
    ``<|video_pad|>``."""

    image_token: str = IMAGE_TOKEN
    video_processor: QwenVideoProcessor = field(default_factory=QwenVideoProcessor)


def build_qwen_processor(model_cfg: Mapping | None = None, tokenizer_dir: Path | None = None, *,
                         image_pixels: tuple[int, int], video: QwenVideoProcessor,
                         **image_settings) -> QwenProcessorBundle:
    """Tokenizer, image and video processors: from ``model_cfg.pretrained`` if set (its saved preprocessor configs
    win; ``video``'s class and defaults where it saved no video config), else the tokenizer asset at
    ``tokenizer_dir``, ``Qwen2VLImageProcessorPil(**image_settings)`` and ``video``.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``image_min_pixels``, ``image_max_pixels`` (defaults:
    ``image_pixels``), ``video_min_pixels``, ``video_max_pixels``, ``video_fps``, ``video_min_frames``,
    ``video_max_frames`` (defaults: ``video``'s). Patch, merge and temporal patch sizes, mean and std of the video
    processor come from the image processor.
    """
    cfg = to_plain(model_cfg) or {}
    bundle = build_processor_bundle(
        QwenProcessorBundle, cfg, Qwen2VLImageProcessorPil, tokenizer_dir,
        min_pixels=int(cfg.get("image_min_pixels") or image_pixels[0]),
        max_pixels=int(cfg.get("image_max_pixels") or image_pixels[1]), **image_settings,
    )
    return replace(bundle, video_processor=grid_video_processor(cfg, video, bundle.image_processor, VIDEO_SETTINGS))
