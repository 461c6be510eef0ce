"""The Qwen families' sample encoders: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, metadata only).

:class:`QwenSampleEncoder` is ChatML with Qwen placeholders (Qwen2-VL's layout): image and video token counts from
the processors (encode) or from headers and container metadata (measure). :class:`Qwen3SampleEncoder` adds
Qwen3-VL's video text (Qwen3.5 uses the same), per ``Qwen3VLProcessor``: a video part's
``<|vision_start|><|video_pad|><|vision_end|>`` becomes one run per temporal patch (two sampled frames):

    <0.3 seconds><|vision_start|><|video_pad|> x (h*w/4) <|vision_end|><1.3 seconds><|vision_start|>...<|vision_end|>

the time being the mean source time of the patch's first and last frame, printed with one decimal. This is the
reference layout (Qwen's own processor and transformers 4.57 replace the whole ``<|vision_start|><|video_pad|>
<|vision_end|>``); transformers 5.24's generic placeholder expansion replaces only ``<|video_pad|>`` and so leaves an
extra ``<|vision_start|>`` / ``<|vision_end|>`` around the runs, which the model was not trained with.

``measure`` renders the same text from the container metadata (frame count, rate, size: the sampled indices,
their timestamps and the frame size follow from it) and tokenises it, so the timestamp tokens are counted exactly;
a clip that then decodes otherwise is a bad record (``video_measure_mismatch``). The template rendering, label
masking, validation and media reading are the kit's ``ChatTemplateEncoder``.
"""

from __future__ import annotations

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder
from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS
from mvp_engine.kit.mllm.data.video import VideoInfo

from .processor import QwenProcessorBundle
from .tokens import IM_END_TOKEN, IM_START_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN

# The family's clips run through its one vision tower (``get_video_features`` calls ``self.visual`` as
# ``get_image_features`` does): an image in a micro-batch reaches every parameter a clip would, so the engine runs
# no dummy video pass beside it
TOWER_VIDEOS = VIDEOS.on_tower_of(IMAGES)
# Clips with Qwen2.5-VL's ``second_per_grid_ts`` (one per clip: the seconds a temporal patch spans, which its M-RoPE
# reads): what its encoder writes, and what the family's packed inputs hand on wherever a batch carries it
TIMED_VIDEOS = TOWER_VIDEOS.with_fields(item_keys=("second_per_grid_ts",))


class QwenSampleEncoder(ChatTemplateEncoder):
    """ChatML with Qwen placeholders; every image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``
    with ``<|image_pad|>`` expanded to the image's merged token count ``t*h*w / merge**2`` (the image processor's
    ``image_grid_thw`` when encoding, ``smart_resize`` on the header size when measuring); a video as one run of
    ``<|video_pad|>`` for the whole clip (the family's video processor on decoded frames, or on the container
    metadata). Only assistant content and its ``<|im_end|>`` are supervised, never a vision special token."""

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN
    video_kind = TOWER_VIDEOS
    assistant_header = f"{IM_START_TOKEN}assistant\n"
    turn_end = IM_END_TOKEN
    unsupervised_tokens = (VISION_START_TOKEN, VISION_END_TOKEN)

    def __init__(self, processor: QwenProcessorBundle):
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


class Qwen3SampleEncoder(QwenSampleEncoder):
    """Qwen3-VL's video text (``Qwen3VLProcessor``; Qwen3.5 uses the same): the template's
    ``<|vision_start|><|video_pad|><|vision_end|>`` of a video becomes, for each temporal patch,
    ``<{t:.1f} seconds><|vision_start|>`` + ``<|video_pad|>`` x (h * w / merge**2) + ``<|vision_end|>``, ``t`` the
    patch's time from the video processor's ``timestamps``. The timestamp text is tokenised with the rest, so
    ``measure`` counts it exactly; it is never supervised (it sits in user turns)."""

    video_part = f"{VISION_START_TOKEN}{VIDEO_TOKEN}{VISION_END_TOKEN}"

    def video_text(self, info: VideoInfo, tokens: int) -> str:
        seconds = self.video_processor.timestamps(info)
        per_frame, rest = divmod(tokens, len(seconds))
        if rest:
            raise ValueError(f"video {info.path!r}: {tokens} tokens do not split into {len(seconds)} frames")
        frame = f"{VISION_START_TOKEN}{VIDEO_TOKEN * per_frame}{VISION_END_TOKEN}"
        return "".join(f"<{t:.1f} seconds>{frame}" for t in seconds)
