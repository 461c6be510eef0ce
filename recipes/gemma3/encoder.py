"""Gemma 3 sample encoder: the family's layout (``recipes.gemma``) with Gemma 3's fixed soft tokens per image.

``measure`` opens every image header (nothing decoded) and counts ``mm_tokens_per_image`` per image, what
``encode`` gets from ``Gemma3ImageProcessorPil`` with pan-and-scan off (on, an image would add crops of its own
count); ``token_type_ids`` mark the soft tokens.
"""

from __future__ import annotations

from mvp_engine.kit.mllm.data.chat import FixedImageTokens
from recipes.gemma import GemmaSampleEncoder

from .model import Gemma3ProcessorBundle


class Gemma3SampleEncoder(FixedImageTokens, GemmaSampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Gemma 3 (``image_seq_length`` soft tokens per image); every error names
    ``record.origin``."""

    def __init__(self, processor: Gemma3ProcessorBundle):
        super().__init__(processor)
        if self.image_processor.do_pan_and_scan:
            raise ValueError("Gemma 3 with pan-and-scan is not supported: measure counts one crop per image")
