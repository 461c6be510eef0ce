"""The Qwen families' model builder: a ``save_pretrained`` folder or a tiny seeded init whose vocabulary and
special-token ids come from the tokenizer (:func:`qwen_tiny_config`), the vision tower keeping flash (it passes its
own cu_seqlens); and :data:`qwen_cost_profile`, the cost model's reading of the Qwen vision side (the engine's
grid-patch tower profile where :data:`QWEN_VISION` says). Its dummy media are the engine's ``grid_dummy_media``."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from mvp_engine.engine import flops
from mvp_engine.engine.builders import build_hf_model, to_plain
from mvp_engine.engine.grid_vision import grid_cost_profile
from mvp_engine.packing import FLASH_BACKENDS, sub_model_attention

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


# the cost model's reading of the Qwen vision side: its grid-patch tower (merge**2 patches per media token) where
# QWEN_VISION says
qwen_cost_profile = partial(grid_cost_profile, parts=QWEN_VISION)
