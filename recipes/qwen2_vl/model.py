"""Model and processor builders for the Qwen2-VL recipe.

The default is a tiny, seeded, randomly initialised ``Qwen2VLForConditionalGeneration`` whose config comes from
YAML (``conf/model/qwen2_vl_tiny.yaml``) and whose vocabulary and special-token ids come from the committed
tokenizer asset (``assets/tokenizers/qwen2_vl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The
generic parts (pretrained vs tiny init, the tokenizer + image processor bundle) are ``mvp_engine.engine.builders``.

Images go through ``Qwen2VLImageProcessorPil``: transformers' torchvision-free backend. ``Qwen2VLProcessor`` is
not used because it insists on a video processor, which needs torchvision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.packing import sub_model_attention, unwrap_model

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen2_vl"

# Small pixel bounds: every image becomes 4..64 merged tokens (one merged token covers 28x28 pixels).
DEFAULT_MIN_PIXELS = 28 * 28 * 4
DEFAULT_MAX_PIXELS = 28 * 28 * 64

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


@dataclass
class Qwen2VLProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Qwen2VLImageProcessorPil``; the image placeholder is ``<|image_pad|>``."""

    image_token: str = IMAGE_TOKEN


def build_processor(model_cfg: Mapping | None = None) -> Qwen2VLProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer.

    Keys read: ``pretrained``, ``tokenizer_dir`` (default: the committed asset), ``image_min_pixels``,
    ``image_max_pixels`` (defaults: 4 and 64 merged tokens per image; ignored for a pretrained dir, whose saved
    preprocessor config wins).
    """
    cfg = to_plain(model_cfg) or {}
    return build_processor_bundle(
        Qwen2VLProcessorBundle, cfg, Qwen2VLImageProcessorPil, DEFAULT_TOKENIZER_DIR,
        min_pixels=int(cfg.get("image_min_pixels") or DEFAULT_MIN_PIXELS),
        max_pixels=int(cfg.get("image_max_pixels") or DEFAULT_MAX_PIXELS),
    )


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
