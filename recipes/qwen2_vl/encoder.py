"""Qwen2-VL sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, headers only).

Layout, per the Qwen2-VL chat template: every image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``
and its ``<|image_pad|>`` is expanded to the image's merged token count ``t*h*w / merge**2`` (the count the model's
vision tower emits, checked by the model at forward time); a video part likewise as
``<|vision_start|><|video_pad|><|vision_end|>``, one run of ``<|video_pad|>`` for the whole clip. Only assistant
turns are supervised: the assistant's content and its closing ``<|im_end|>``; the template's role header and
trailing newline are not. Vision special tokens are never supervised, even inside an assistant turn.

The template rendering, label masking, validation and image reading are the kit's ``ChatTemplateEncoder``; the
token counts are the Qwen families' shared ``QwenSampleEncoder`` (``recipes.qwen``): the image
processor's ``image_grid_thw`` (encode) or ``smart_resize`` on the header size (measure); for videos the family's
``QwenVideoProcessor`` on decoded frames (encode) or on the container metadata (measure). Tests check that they
agree.
"""

from __future__ import annotations

from recipes.qwen import QwenSampleEncoder


class Qwen2VLSampleEncoder(QwenSampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Qwen2-VL; every error names ``record.origin``."""
