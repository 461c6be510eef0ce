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

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder, FixedImageTokens

from .model import IMAGE_TOKEN


class LlavaSampleEncoder(FixedImageTokens, ChatTemplateEncoder):
    """Implements ``MLLMSampleEncoder`` for LLaVA (``LlavaProcessorBundle.image_seq_length`` tokens per image);
    every error names ``record.origin``."""

    image_token = IMAGE_TOKEN
    assistant_header = "ASSISTANT:"
    turn_end = "</s>"
