"""Model and processor builders for the Qwen2-VL recipe.

No hub is reachable, so the default is a tiny, seeded, randomly initialised ``Qwen2VLForConditionalGeneration``
whose config comes from YAML (``conf/model/qwen2_vl_tiny.yaml``) and whose vocabulary and special-token ids come
from the committed tokenizer asset (``assets/tokenizers/qwen2_vl``, built by ``tools/build_tokenizer_assets.py``).
``pretrained=<dir>`` instead loads a ``save_pretrained`` folder (model, tokenizer, image processor).

Images go through ``Qwen2VLImageProcessorPil``: transformers' torchvision-free backend. ``Qwen2VLProcessor`` is
not used because it insists on a video processor, which needs torchvision; ``Qwen2VLProcessorBundle`` holds
the two pieces instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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


def to_plain(cfg: Any) -> Any:
    """A Hydra ``DictConfig`` / nested mapping as plain dicts and lists (None stays None)."""
    if cfg is None:
        return None
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - hydra is a dependency, but the builders do not need it
        pass
    if isinstance(cfg, Mapping):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    return cfg


@dataclass
class Qwen2VLProcessorBundle:
    """Tokenizer + PIL image processor, with the special-token ids the encoder and model config need."""

    tokenizer: PreTrainedTokenizerBase
    image_processor: Qwen2VLImageProcessorPil

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id and token != self.tokenizer.unk_token:
            raise ValueError(f"tokenizer has no {token!r} token; rebuild it with tools/build_tokenizer_assets.py")
        return int(token_id)

    @property
    def image_token_id(self) -> int:
        return self.token_id(IMAGE_TOKEN)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def save_pretrained(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)


def build_processor(model_cfg: Mapping | None = None) -> Qwen2VLProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer.

    Keys read: ``pretrained``, ``tokenizer_dir`` (default: the committed asset), ``image_min_pixels``,
    ``image_max_pixels`` (defaults: 4 and 64 merged tokens per image; ignored for a pretrained dir, whose saved
    preprocessor config wins).
    """
    cfg = to_plain(model_cfg) or {}
    pretrained = cfg.get("pretrained")
    if pretrained:
        return Qwen2VLProcessorBundle(
            tokenizer=AutoTokenizer.from_pretrained(pretrained),
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(pretrained),
        )
    tokenizer_dir = cfg.get("tokenizer_dir") or DEFAULT_TOKENIZER_DIR
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=int(cfg.get("image_min_pixels") or DEFAULT_MIN_PIXELS),
        max_pixels=int(cfg.get("image_max_pixels") or DEFAULT_MAX_PIXELS),
    )
    return Qwen2VLProcessorBundle(AutoTokenizer.from_pretrained(str(tokenizer_dir)), image_processor)


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
    cfg = to_plain(model_cfg) or {}
    dtype = getattr(torch, str(cfg.get("dtype") or "float32"))
    if cfg.get("pretrained"):
        return Qwen2VLForConditionalGeneration.from_pretrained(
            cfg["pretrained"], attn_implementation=attn_implementation, dtype=dtype
        )
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.get("tokenizer_dir") or DEFAULT_TOKENIZER_DIR))
    config = tiny_config(cfg, tokenizer)
    # fork_rng: the seeded init must not move the caller's global RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.get("seed") or 0))
        model = Qwen2VLForConditionalGeneration._from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )
    return model
