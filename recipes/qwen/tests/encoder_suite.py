"""What the Qwen3-VL and Qwen3.5 encoder suites share (one encoder class, ``recipes.qwen.Qwen3SampleEncoder``, and
one transformers processor, ``Qwen3VLProcessor``): the hook and the measured reason their clips are not compared
through that processor."""

from __future__ import annotations

from transformers import Qwen3VLProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite


class Qwen3EncoderSuite(EncoderSuite):
    """``EncoderSuite`` over ``Qwen3VLProcessor`` (transformers' processor for Qwen3-VL and Qwen3.5), images and
    text only; the clips' runs are compared with ``Qwen3VLProcessor.replace_video_token`` in
    ``recipes/qwen3_vl/tests/test_encoder.py``."""

    video_not_compared = (
        "transformers 5.24's Qwen3VLProcessor replaces only the <|video_pad|> of the template's "
        "<|vision_start|><|video_pad|><|vision_end|> with the timestamped per-frame runs, so its text keeps an extra "
        "<|vision_start|> before the runs and <|vision_end|> after them (measured on every clip of "
        "varied_video_records); the encoder writes the reference layout (Qwen's processor, transformers 4.57)")

    @classmethod
    def hf_processor(cls, encoder):
        return kit.transformers_processor(Qwen3VLProcessor, encoder)
