"""LLaVA sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, headers only).

Layout, per the LLaVA-1.5 chat template of the tokenizer asset (``USER: <image>\\n... ASSISTANT: ...</s>``): every
image part renders as ``<image>`` and is expanded to the model's fixed number of image tokens per image
(``LlavaProcessorBundle.image_seq_length``; the model checks the count at forward time). Only assistant turns are
supervised: the answer (its leading space included, as Llama's ``▁word`` pieces carry it) and the closing ``</s>``;
``ASSISTANT:`` and the line break after the turn are not. The template rendering, label masking, validation and
image reading are the kit's ``ChatTemplateEncoder``.

``measure`` still opens every image header (without decoding it): a record whose image is missing or unreadable
fails at planning, naming the record, not in the middle of an epoch.
"""

from __future__ import annotations

import torch
from PIL import Image

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder

from .model import IMAGE_TOKEN, LlavaProcessorBundle


class LlavaSampleEncoder(ChatTemplateEncoder):
    """Implements ``MLLMSampleEncoder`` for LLaVA; every error names ``record.origin``."""

    image_token = IMAGE_TOKEN
    assistant_header = "ASSISTANT:"
    turn_end = "</s>"

    def __init__(self, processor: LlavaProcessorBundle):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        self.tokens_per_image = int(processor.image_seq_length)
        if self.tokens_per_image < 1:
            raise ValueError("LlavaProcessorBundle.image_seq_length must be set (build it with build_processor)")

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixel_values}, [self.tokens_per_image] * len(images)

    def image_token_count(self, width: int, height: int) -> int:
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        return self.tokens_per_image
