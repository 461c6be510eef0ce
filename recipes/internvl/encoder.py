"""InternVL sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, headers only).

Layout, per ``InternVLProcessor`` and the chat template of the tokenizer asset (ChatML; an image part renders as
``<IMG_CONTEXT>\\n``): every image's ``<IMG_CONTEXT>`` becomes ``<img>`` + ``<IMG_CONTEXT>`` x (tiles x tokens per
tile) + ``</img>``, the tiles counted by the image processor (``encode``) or from the image header (``measure``,
the same ``get_optimal_tiled_canvas``). Only assistant content and its ``<|im_end|>`` are supervised, never
``<img>`` / ``</img>`` nor the context tokens. The media fields are the stacked tiles ``pixel_values`` and
``image_num_patches`` (tiles per image), so a pack knows which tiles belong to which image.
"""

from __future__ import annotations

import torch
from PIL import Image

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder
from mvp_engine.kit.mllm.data.media import IMAGES

from .model import InternVLProcessorBundle, image_tiles
from .tokens import CONTEXT_IMAGE_TOKEN, END_IMAGE_TOKEN, IM_END_TOKEN, IM_START_TOKEN, START_IMAGE_TOKEN


class InternVLSampleEncoder(ChatTemplateEncoder):
    """Implements ``MLLMSampleEncoder`` for InternVL; every error names ``record.origin``."""

    image_token = CONTEXT_IMAGE_TOKEN
    image_part = CONTEXT_IMAGE_TOKEN
    assistant_header = f"{IM_START_TOKEN}assistant\n"
    turn_end = IM_END_TOKEN
    unsupervised_tokens = (START_IMAGE_TOKEN, END_IMAGE_TOKEN)
    image_kind = IMAGES.with_fields(count_key="image_num_patches")  # stacked tiles, counted per image

    def __init__(self, processor: InternVLProcessorBundle):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        self.tokens_per_tile = int(processor.image_seq_length)
        if self.tokens_per_tile < 1:
            raise ValueError("InternVLProcessorBundle.image_seq_length must be set (build it with build_processor)")

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        out = self.image_processor(images=images, return_tensors="pt")
        tiles = torch.as_tensor(out["num_patches"], dtype=torch.long)
        counts = [int(n) * self.tokens_per_tile for n in tiles]
        return {"pixel_values": out["pixel_values"], "image_num_patches": tiles}, counts

    def image_token_count(self, width: int, height: int) -> int:
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        return image_tiles(self.image_processor, width, height) * self.tokens_per_tile

    def image_text(self, tokens: int) -> str:
        return f"{START_IMAGE_TOKEN}{self.image_token * tokens}{END_IMAGE_TOKEN}"
