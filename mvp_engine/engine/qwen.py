"""What the Qwen vision-language recipes share (Qwen2-VL, Qwen3-VL; Qwen3.5 next): written once, used by each.

- Tokens: ``<|image_pad|>`` / ``<|video_pad|>`` placeholders inside ``<|vision_start|>...<|vision_end|>``, ChatML turns
  (``<|im_start|>role\\n ... <|im_end|>``), ``<|endoftext|>`` as padding and bos, ``<|im_end|>`` as eos.
- :class:`QwenProcessorBundle` / :func:`build_qwen_processor`: tokenizer + ``Qwen2VLImageProcessorPil`` (transformers'
  torchvision-free image processor, which every Qwen family uses with its own patch size, mean and std) + the kit's
  numpy/PIL video processor (``QwenVideoProcessor`` for Qwen2-VL, ``Qwen3VideoProcessor`` for Qwen3-VL / Qwen3.5),
  whose patch sizes, mean and std are taken from the image processor so images and videos meet the tower alike.
- :func:`build_qwen_model`: a ``save_pretrained`` folder or a tiny seeded init whose vocabulary and special-token ids
  come from the tokenizer (:func:`qwen_tiny_config`); the vision tower keeps flash (it passes its own cu_seqlens).
- :func:`qwen_dummy_media`: the smallest image the vision tower takes, for the zero-weighted media pass.
- :class:`QwenSampleEncoder`: the ChatML encoder with image and video counts from the processors (encode) or from
  headers and container metadata (measure); :class:`Qwen3SampleEncoder` adds Qwen3-VL's video text layout, one
  ``<{t:.1f} seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` run per temporal patch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder
from mvp_engine.kit.mllm.data.video import VideoInfo
from mvp_engine.kit.mllm.data.video_patches import QwenVideoProcessor
from mvp_engine.packing import sub_model_attention, unwrap_model

from .builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
VIDEO_SETTINGS = ("min_pixels", "max_pixels", "fps", "min_frames", "max_frames")  # model.video_<key>


@dataclass
class QwenProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Qwen2VLImageProcessorPil`` + the kit's video processor; placeholders ``<|image_pad|>`` and
    ``<|video_pad|>``."""

    image_token: str = IMAGE_TOKEN
    video_processor: QwenVideoProcessor = field(default_factory=QwenVideoProcessor)

    def save_pretrained(self, directory: str | Path) -> None:
        super().save_pretrained(directory)
        self.video_processor.save_pretrained(directory)


def build_qwen_processor(model_cfg: Mapping | None = None, tokenizer_dir: Path | None = None, *,
                         image_pixels: tuple[int, int], video: QwenVideoProcessor,
                         **image_settings) -> QwenProcessorBundle:
    """Tokenizer, image and video processors: from ``model_cfg.pretrained`` if set (its saved preprocessor configs
    win; ``video``'s class and defaults where it saved no video config), else the tokenizer asset at
    ``tokenizer_dir``, ``Qwen2VLImageProcessorPil(**image_settings)`` and ``video``.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``image_min_pixels``, ``image_max_pixels`` (defaults:
    ``image_pixels``), ``video_min_pixels``, ``video_max_pixels``, ``video_fps``, ``video_min_frames``,
    ``video_max_frames`` (defaults: ``video``'s). Patch, merge and temporal patch sizes, mean and std of the video
    processor come from the image processor.
    """
    cfg = to_plain(model_cfg) or {}
    bundle = build_processor_bundle(
        QwenProcessorBundle, cfg, Qwen2VLImageProcessorPil, tokenizer_dir,
        min_pixels=int(cfg.get("image_min_pixels") or image_pixels[0]),
        max_pixels=int(cfg.get("image_max_pixels") or image_pixels[1]), **image_settings,
    )
    images = bundle.image_processor
    patches = {"patch_size": int(images.patch_size), "merge_size": int(images.merge_size),
               "temporal_patch_size": int(images.temporal_patch_size), "image_mean": tuple(images.image_mean),
               "image_std": tuple(images.image_std)}
    if cfg.get("pretrained"):
        video = type(video).from_pretrained(cfg["pretrained"], **patches)
    else:
        video = replace(video, **patches, **{key: cfg[f"video_{key}"] for key in VIDEO_SETTINGS
                                             if cfg.get(f"video_{key}")})
    return replace(bundle, video_processor=video)


def qwen_tiny_config(config_cls, model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase, vision_out: str):
    """``config_cls`` from ``model_cfg.config`` (text_config / vision_config dicts, top-level fields), with the
    vocabulary size and every special-token id taken from the tokenizer so they can never disagree, and the vision
    tower's output width (``vision_out``: the vision config's key for it) set to the text width."""
    cfg = to_plain(model_cfg) or {}
    raw = dict(cfg.get("config") or {})
    text = dict(raw.pop("text_config", None) or {})
    vision = dict(raw.pop("vision_config", None) or {})

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    text.update(vocab_size=len(tokenizer), pad_token_id=int(tokenizer.pad_token_id), bos_token_id=tid(PAD_TOKEN),
                eos_token_id=tid(IM_END_TOKEN))
    vision.setdefault(vision_out, text.get("hidden_size"))  # the merger projects into the text width
    return config_cls(text_config=text, vision_config=vision, image_token_id=tid(IMAGE_TOKEN),
                      video_token_id=tid(VIDEO_TOKEN), vision_start_token_id=tid(VISION_START_TOKEN),
                      vision_end_token_id=tid(VISION_END_TOKEN), **raw)


def build_qwen_model(model_cls, config_cls, model_cfg: Mapping | None, attn_implementation: str = "sdpa",
                     tokenizer_dir: Path | None = None, vision_out: str = "out_hidden_size"):
    """``model_cls.from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init of
    :func:`qwen_tiny_config` (``config_cls``; the tokenizer asset at ``tokenizer_dir``). Keys read: ``pretrained``,
    ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level config fields), ``seed`` (default
    0), ``dtype`` (default float32)."""
    # the vision tower keeps flash (it passes its own cu_seqlens; transformers keeps the language model's away)
    attention = sub_model_attention(attn_implementation, vision_shares=("eager", "sdpa", *FLASH_BACKENDS))

    def tiny_config(cfg: Mapping, tokenizer: PreTrainedTokenizerBase):
        return qwen_tiny_config(config_cls, cfg, tokenizer, vision_out)

    return build_hf_model(model_cls, model_cfg, attention, tiny_config, tokenizer_dir)


def qwen_dummy_media(model) -> dict:
    """``get_image_features`` kwargs for the smallest image the vision tower takes: one merged token (a
    ``spatial_merge_size`` square of patches), zero pixels. Run zero-weighted on image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    merge = vision.spatial_merge_size
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"pixel_values": torch.zeros(merge * merge, patch_values),
            "image_grid_thw": torch.tensor([[1, merge, merge]])}


class QwenSampleEncoder(ChatTemplateEncoder):
    """ChatML with Qwen placeholders; every image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``
    with ``<|image_pad|>`` expanded to the image's merged token count ``t*h*w / merge**2`` (the image processor's
    ``image_grid_thw`` when encoding, ``smart_resize`` on the header size when measuring); a video as one run of
    ``<|video_pad|>`` for the whole clip (the kit's video processor on decoded frames, or on the container
    metadata). Only assistant content and its ``<|im_end|>`` are supervised, never a vision special token."""

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN
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
