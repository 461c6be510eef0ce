"""The Qwen families' model builder: a ``save_pretrained`` folder or a tiny seeded init whose vocabulary and
special-token ids come from the tokenizer (:func:`qwen_tiny_config`), the vision tower keeping flash (it passes its
own cu_seqlens); :func:`qwen_dummy_media`, the smallest image the vision tower takes, for the zero-weighted
media pass; and :func:`qwen_cost_profile`, the cost model's reading of the Qwen vision side."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from mvp_engine.engine import flops
from mvp_engine.engine.builders import build_hf_model, to_plain
from mvp_engine.kit.mllm.data import CostProfile
from mvp_engine.packing import FLASH_BACKENDS, sub_model_attention, unwrap_model

from .tokens import IM_END_TOKEN, IMAGE_TOKEN, PAD_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN

# model.visual is the tower, its merger (Qwen3-VL: and the deepstack mergers beside it) the projector
QWEN_VISION = flops.VisionParts(tower=("visual",), projector=("merger",))


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


def qwen_cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = ()) -> CostProfile:
    """The engine's cost profile (``mvp_engine.engine.flops``) of a Qwen-style vision side: :data:`QWEN_VISION`,
    one media token per ``spatial_merge_size`` square of patches."""
    merge = int(unwrap_model(model).config.vision_config.spatial_merge_size)
    return flops.cost_profile(model, unreachable, QWEN_VISION, patches_per_media_token=merge * merge)
