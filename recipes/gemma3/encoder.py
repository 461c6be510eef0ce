"""Gemma 3 sample encoder: the family's layout (``recipes.gemma``) with Gemma 3's fixed soft tokens per image.

``measure`` opens every image header (nothing decoded) and counts ``mm_tokens_per_image`` per image, what
``encode`` gets from ``Gemma3ImageProcessorPil`` with pan-and-scan off (on, an image would add crops of its own
count); ``token_type_ids`` mark the soft tokens.
"""

from __future__ import annotations

import torch
from PIL import Image

from recipes.gemma import GemmaSampleEncoder

from .model import Gemma3ProcessorBundle


class Gemma3SampleEncoder(GemmaSampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Gemma 3; every error names ``record.origin``."""

    def __init__(self, processor: Gemma3ProcessorBundle):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        self.tokens_per_image = int(processor.image_seq_length)
        if self.tokens_per_image < 1:
            raise ValueError("Gemma3ProcessorBundle.image_seq_length must be set (build it with build_processor)")
        if self.image_processor.do_pan_and_scan:
            raise ValueError("Gemma 3 with pan-and-scan is not supported: measure counts one crop per image")

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixel_values}, [self.tokens_per_image] * len(images)

    def image_token_count(self, width: int, height: int) -> int:
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        return self.tokens_per_image
