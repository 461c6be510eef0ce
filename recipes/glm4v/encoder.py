"""GLM-4.1V's sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, metadata only).

An image is ``<|begin_of_image|>`` + ``<|image|>`` x (h * w / merge**2) + ``<|end_of_image|>``, its count from
``Glm4vImageProcessorPil``'s ``image_grid_thw`` (encode) or GLM's ``smart_resize`` on the header size (measure). A
video part's ``<|video|>`` becomes, per temporal patch (two sampled frames), as ``Glm4vProcessor`` writes it:

    <|begin_of_image|><|image|> x (h*w/4) <|end_of_image|>0<|begin_of_image|>...<|end_of_image|>1

inside the template's ``<|begin_of_video|>...<|end_of_video|>``, the number after each frame its whole source
seconds; ``measure`` renders the same text from the container metadata, so the timestamp tokens are counted
exactly. Video frames reuse the image placeholder: ``mm_token_type_ids`` (1 image, 2 video, as
``Glm4vProcessor.create_mm_token_type_ids``) mark the placeholders between the video markers as video, and the
kit checks each kind's token count by those types. Only assistant content and its closing ``<|endoftext|>`` are
supervised.
"""

from __future__ import annotations

import torch
from PIL import Image
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder
from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS
from mvp_engine.kit.mllm.data.video import VideoInfo

from .model import Glm4vProcessorBundle
from .tokens import ASSISTANT_TOKEN, BEGIN_IMAGE, BEGIN_VIDEO, END_IMAGE, END_VIDEO, IMAGE_TOKEN, PAD_TOKEN, VIDEO_TOKEN

TYPE_FIELD = "mm_token_type_ids"
# clips run through the image tower (``self.visual``): an image reaches every parameter a clip would, no dummy video
# pass beside it
TOWER_VIDEOS = VIDEOS.on_tower_of(IMAGES)


class Glm4vSampleEncoder(ChatTemplateEncoder):
    """Implements ``MLLMSampleEncoder`` for GLM-4.1V / 4.5V; every error names ``record.origin``."""

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN
    video_kind = TOWER_VIDEOS
    assistant_header = f"{ASSISTANT_TOKEN}\n"
    turn_end = PAD_TOKEN
    unsupervised_tokens = (BEGIN_IMAGE, END_IMAGE, BEGIN_VIDEO, END_VIDEO)
    token_type_field = TYPE_FIELD

    def __init__(self, processor: Glm4vProcessorBundle):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        self.video_processor = processor.video_processor
        self.merge_size = int(self.image_processor.merge_size)
        self._video_markers = (processor.token_id(BEGIN_VIDEO), processor.token_id(END_VIDEO))

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        return ({"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                [int(n) for n in grid.prod(-1) // self.merge_size**2])

    def image_token_count(self, width: int, height: int) -> int:
        processor = self.image_processor
        patch, temporal = int(processor.patch_size), int(processor.temporal_patch_size)
        h, w = smart_resize(temporal, height, width, temporal_factor=temporal, factor=patch * self.merge_size,
                            min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"])
        return (h // patch) * (w // patch) // self.merge_size**2

    def encode_videos(self, videos: list[VideoInfo]) -> tuple[dict[str, torch.Tensor], list[int]]:
        return self.video_processor(videos)

    def video_token_count(self, info: VideoInfo) -> int:
        return self.video_processor.token_count(info)

    def video_text(self, info: VideoInfo, tokens: int) -> str:
        seconds = self.video_processor.timestamps(info)
        per_frame, rest = divmod(tokens, len(seconds))
        if rest:
            raise ValueError(f"video {info.path!r}: {tokens} tokens do not split into {len(seconds)} frames")
        return "".join(f"{BEGIN_IMAGE}{IMAGE_TOKEN * per_frame}{END_IMAGE}{t}" for t in seconds)

    def placeholder_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on image placeholders, 2 on those between ``<|begin_of_video|>`` and ``<|end_of_video|>``."""
        begin, end = self._video_markers
        in_video = torch.cumsum(input_ids == begin, 0) > torch.cumsum(input_ids == end, 0)
        placeholder = input_ids == self.image_token_id
        return torch.where(placeholder, torch.where(in_video, 2, 1), 0).to(input_ids.dtype)
