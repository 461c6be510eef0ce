"""Qwen2-VL sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, headers only).

Layout, per the Qwen2-VL chat template: every image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``
and its ``<|image_pad|>`` is expanded to the image's merged token count ``t*h*w / merge**2`` (the count the model's
vision tower emits, checked by the model at forward time); a video part likewise as
``<|vision_start|><|video_pad|><|vision_end|>``, one run of ``<|video_pad|>`` for the whole clip. Only assistant
turns are supervised: the assistant's content and its closing ``<|im_end|>``; the template's role header and
trailing newline are not. Vision special tokens are never supervised, even inside an assistant turn.

The template rendering, label masking, validation and image reading are the kit's ``ChatTemplateEncoder``; this
class supplies the token counts: the image processor's ``image_grid_thw`` (encode) or ``smart_resize`` on the
header size (measure); for videos the kit's ``QwenVideoProcessor`` on decoded frames (encode) or on the container
metadata (measure). Tests check that they agree.
"""

from __future__ import annotations

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder
from mvp_engine.kit.mllm.data.video import VideoInfo

from .model import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN, Qwen2VLProcessorBundle


class Qwen2VLSampleEncoder(ChatTemplateEncoder):
    """Implements ``MLLMSampleEncoder`` for Qwen2-VL; every error names ``record.origin``."""

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN
    assistant_header = "<|im_start|>assistant\n"
    turn_end = "<|im_end|>"
    unsupervised_tokens = (VISION_START_TOKEN, VISION_END_TOKEN)

    def __init__(self, processor: Qwen2VLProcessorBundle):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        size = self.image_processor.size
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.patch_size = int(self.image_processor.patch_size)
        self.merge_size = int(self.image_processor.merge_size)
        self.video_processor = processor.video_processor

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        counts = [int(n) for n in grid.prod(-1) // self.merge_size**2]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts

    def image_token_count(self, width: int, height: int) -> int:
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def encode_videos(self, videos: list[VideoInfo]) -> tuple[dict[str, torch.Tensor], list[int]]:
        return self.video_processor(videos)

    def video_token_count(self, info: VideoInfo) -> int:
        return self.video_processor.token_count(info)
