"""Qwen3-VL sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, metadata only).

Layout, per the Qwen3-VL chat template and ``Qwen3VLProcessor``: an image part renders as
``<|vision_start|><|image_pad|><|vision_end|>`` with ``<|image_pad|>`` expanded to the image's merged token count
(as in Qwen2-VL, at 32 px per merged token). A video part's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes
one run per temporal patch (two sampled frames):

    <0.3 seconds><|vision_start|><|video_pad|> x (h*w/4) <|vision_end|><1.3 seconds><|vision_start|>...<|vision_end|>

the time being the mean source time of the patch's first and last frame, printed with one decimal. This is the
reference layout (Qwen's own processor and transformers 4.57 replace the whole ``<|vision_start|><|video_pad|>
<|vision_end|>``); transformers 5.24's generic placeholder expansion replaces only ``<|video_pad|>`` and so leaves an
extra ``<|vision_start|>`` / ``<|vision_end|>`` around the runs, which the model was not trained with.

``measure`` renders the same text from the container metadata (frame count, rate, size: the sampled indices,
their timestamps and the frame size follow from it) and tokenises it, so the timestamp tokens are counted exactly;
a clip that then decodes otherwise is a bad record (``video_measure_mismatch``). Only assistant content and its
``<|im_end|>`` are supervised. Everything here is shared with Qwen3.5 (``mvp_engine.engine.qwen``).
"""

from __future__ import annotations

from mvp_engine.engine.qwen import Qwen3SampleEncoder


class Qwen3VLSampleEncoder(Qwen3SampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Qwen3-VL; every error names ``record.origin``."""
