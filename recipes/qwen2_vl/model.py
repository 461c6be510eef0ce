"""Model and processor builders for the Qwen2-VL recipe.

The default is a tiny, seeded, randomly initialised ``Qwen2VLForConditionalGeneration`` whose config comes from
YAML (``conf/model/qwen2_vl_tiny.yaml``) and whose vocabulary and special-token ids come from the committed
tokenizer asset (``assets/tokenizers/qwen2_vl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The
generic parts (pretrained vs tiny init, the tokenizer + image processor bundle) are ``mvp_engine.engine.builders``.

Images go through ``Qwen2VLImageProcessorPil``: transformers' torchvision-free backend. ``Qwen2VLProcessor`` is
not used because it insists on a video processor, which needs torchvision; videos go through the kit's
``QwenVideoProcessor`` (numpy/PIL, the same layout as ``Qwen2VLVideoProcessor``) instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.kit.mllm.data.video_patches import QwenVideoProcessor
from mvp_engine.packing import sub_model_attention, unwrap_model

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen2_vl"

# Small pixel bounds: every image becomes 4..64 merged tokens (one merged token covers 28x28 pixels).
DEFAULT_MIN_PIXELS = 28 * 28 * 4
DEFAULT_MAX_PIXELS = 28 * 28 * 64
# Video frames: 4..16 merged tokens per frame pair; 2 frames a second, 4..16 frames per clip.
DEFAULT_VIDEO = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16, "fps": 2.0, "min_frames": 4, "max_frames": 16}

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


@dataclass
class Qwen2VLProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Qwen2VLImageProcessorPil`` + the kit's ``QwenVideoProcessor``; the placeholders are
    ``<|image_pad|>`` and ``<|video_pad|>``."""

    image_token: str = IMAGE_TOKEN
    video_processor: QwenVideoProcessor = field(default_factory=QwenVideoProcessor)

    def save_pretrained(self, directory: str | Path) -> None:
        super().save_pretrained(directory)
        self.video_processor.save_pretrained(directory)


def build_processor(model_cfg: Mapping | None = None) -> Qwen2VLProcessorBundle:
    """Tokenizer, image and video processors: from ``model_cfg.pretrained`` if set, else the asset tokenizer.

    Keys read: ``pretrained``, ``tokenizer_dir`` (default: the committed asset), ``image_min_pixels``,
    ``image_max_pixels`` (defaults: 4 and 64 merged tokens per image), ``video_min_pixels``, ``video_max_pixels``
    (per frame), ``video_fps``, ``video_min_frames``, ``video_max_frames`` (defaults: ``DEFAULT_VIDEO``). The
    media keys are ignored for a pretrained dir, whose saved preprocessor configs win (transformers' Qwen2-VL
    video defaults where it saved none). Patch, merge and temporal patch sizes, mean and std come from the image
    processor, so images and videos meet the vision tower alike.
    """
    cfg = to_plain(model_cfg) or {}
    bundle = build_processor_bundle(
        Qwen2VLProcessorBundle, cfg, Qwen2VLImageProcessorPil, DEFAULT_TOKENIZER_DIR,
        min_pixels=int(cfg.get("image_min_pixels") or DEFAULT_MIN_PIXELS),
        max_pixels=int(cfg.get("image_max_pixels") or DEFAULT_MAX_PIXELS),
    )
    images = bundle.image_processor
    patches = {"patch_size": int(images.patch_size), "merge_size": int(images.merge_size),
               "temporal_patch_size": int(images.temporal_patch_size), "image_mean": tuple(images.image_mean),
               "image_std": tuple(images.image_std)}
    if cfg.get("pretrained"):
        video = QwenVideoProcessor.from_pretrained(cfg["pretrained"], **patches)
    else:
        video = QwenVideoProcessor(**patches, **{key: cfg.get(f"video_{key}") or value
                                                 for key, value in DEFAULT_VIDEO.items()})
    return replace(bundle, video_processor=video)


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase) -> Qwen2VLConfig:
    """``Qwen2VLConfig`` from ``model_cfg.config`` (text_config / vision_config dicts), with the vocabulary size
    and every special-token id taken from the tokenizer so they can never disagree."""
    cfg = to_plain(model_cfg) or {}
    raw = dict(cfg.get("config") or {})
    text = dict(raw.pop("text_config", None) or {})
    vision = dict(raw.pop("vision_config", None) or {})

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    text.update(
        vocab_size=len(tokenizer),
        pad_token_id=int(tokenizer.pad_token_id),
        bos_token_id=tid(PAD_TOKEN),
        eos_token_id=tid(IM_END_TOKEN),
    )
    vision.setdefault("hidden_size", text.get("hidden_size"))  # the merger projects into the text width
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tid(IMAGE_TOKEN),
        video_token_id=tid(VIDEO_TOKEN),
        vision_start_token_id=tid(VISION_START_TOKEN),
        vision_end_token_id=tid(VISION_END_TOKEN),
        **raw,
    )


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Qwen2VLForConditionalGeneration:
    """The Qwen2-VL model: ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level
    Qwen2VLConfig fields), ``seed`` (default 0), ``dtype`` (default float32).
    """
    # the vision tower keeps flash (it passes its own cu_seqlens; transformers keeps the language model's away)
    attention = sub_model_attention(attn_implementation, vision_shares=("eager", "sdpa", *FLASH_BACKENDS))
    return build_hf_model(Qwen2VLForConditionalGeneration, model_cfg, attention, tiny_config, DEFAULT_TOKENIZER_DIR)


def dummy_media(model) -> dict:
    """``get_image_features`` kwargs for the smallest image the vision tower takes: one merged token (a
    ``spatial_merge_size`` square of patches), zero pixels. Run zero-weighted on image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    merge = vision.spatial_merge_size
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"pixel_values": torch.zeros(merge * merge, patch_values),
            "image_grid_thw": torch.tensor([[1, merge, merge]])}
