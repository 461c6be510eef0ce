"""Gemma 4 sample encoder: the family's layout (``recipes.gemma``) with Gemma 4's turns and image tokens.

Gemma 4's template renders an image as ``\\n\\n<|image|>\\n\\n``; the placeholder becomes ``<|image>``, the image's
soft tokens, ``<image|>`` (as ``Gemma4Processor.replace_image_token``). An image's soft-token count depends on its
size: ``measure`` reads it from the image header (nothing decoded) through the processor's own resize arithmetic,
``encode`` takes it from ``Gemma4ImageProcessorPil``'s output; ``mm_token_type_ids`` mark the soft tokens.
"""

from __future__ import annotations

import torch
from PIL import Image

from mvp_engine.kit.mllm.data.media import IMAGES
from recipes.gemma import GemmaSampleEncoder

from .model import PATCH_POSITIONS, TYPE_FIELD, Gemma4ProcessorBundle
from .tokens import BOI_TOKEN, END_OF_TURN, EOI_TOKEN, IMAGE_SOFT_TOKEN, START_OF_TURN


class Gemma4SampleEncoder(GemmaSampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Gemma 4; every error names ``record.origin``."""

    image_token = IMAGE_SOFT_TOKEN
    image_part = IMAGE_SOFT_TOKEN
    boi_token = BOI_TOKEN
    eoi_token = EOI_TOKEN
    assistant_header = f"{START_OF_TURN}model\n"
    turn_end = END_OF_TURN
    unsupervised_tokens = (BOI_TOKEN, EOI_TOKEN)
    token_type_field = TYPE_FIELD
    image_kind = IMAGES.with_fields(item_keys=(PATCH_POSITIONS,))  # pre-patchified images padded to one size

    def __init__(self, processor: Gemma4ProcessorBundle):
        super().__init__(processor)
        self.bundle = processor
        self.image_processor = processor.image_processor

    def image_text(self, tokens: int) -> str:
        return f"{self.boi_token}{self.image_token * tokens}{self.eoi_token}"

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        out = self.image_processor(images=images, return_tensors="pt")
        media = {"pixel_values": out["pixel_values"], PATCH_POSITIONS: out[PATCH_POSITIONS]}
        return media, [int(n) for n in out["num_soft_tokens_per_image"]]

    def image_token_count(self, width: int, height: int) -> int:
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        return self.bundle.soft_tokens(width, height)
