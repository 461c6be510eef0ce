"""Model and processor builders for the Gemma 4 recipe.

The default is a tiny, seeded, randomly initialised ``Gemma4ForConditionalGeneration`` whose config comes from YAML
(``conf/model/gemma4_tiny.yaml``): a Gemma 4 text model with sliding-window and full-attention layers (the full ones
with their own wider heads, as the released checkpoints), ``use_bidirectional_attention="vision"`` as the released
checkpoints that have it (each image a bidirectional block in the sliding layers only), the Gemma 4 vision tower and
its embedder, no audio tower; vocabulary and special-token ids come from the committed tokenizer asset
(``assets/tokenizers/gemma4``). ``pretrained=<dir>`` loads a ``save_pretrained`` folder.

Images go through ``Gemma4ImageProcessorPil`` (no torchvision): resized keeping their aspect ratio to at most
``image_max_soft_tokens`` x k² patches (k = the vision tower's ``pooling_kernel_size``), patchified and padded to
that many patches (``pixel_values`` [N, max_patches, 3 p²], ``image_position_ids`` [N, max_patches, 2], -1 for
padding); an image is (its patches / k²) soft tokens, a function of its size alone (``soft_tokens``).

Attention: the language model runs the configured backend; the vision tower (each image alone, its padding masked)
runs sdpa unless the language model runs eager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, PreTrainedTokenizerBase
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

from mvp_engine.engine import flops
from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.kit.mllm.data import CostProfile, Rate
from mvp_engine.packing import sub_model_attention, unwrap_model

from .tokens import BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "gemma4"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Gemma4Config.model_type,)
TYPE_FIELD = "mm_token_type_ids"
PATCH_POSITIONS = "image_position_ids"  # per image, each patch's (x, y); -1 on the padding patches
IMAGE_TYPE = 1  # transformers' create_mm_token_type_ids: 1 = image soft token
VISION = flops.VisionParts(tower=("vision_tower",), projector=("embed_vision",))
BLOCK_LAYER_TYPES = ("sliding_attention",)  # use_bidirectional_attention="vision": no blocks in the full layers


@dataclass
class Gemma4ProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Gemma4ImageProcessorPil``."""

    image_token: str = IMAGE_SOFT_TOKEN

    def soft_tokens(self, width: int, height: int) -> int:
        """Soft tokens of a ``width`` x ``height`` image: what the processor's resize leaves, in pooled patches
        (transformers' own ``get_aspect_ratio_preserving_size``, which ``Gemma4ImageProcessorPil`` resizes by)."""
        processor = self.image_processor
        k, patch = int(processor.pooling_kernel_size), int(processor.patch_size)
        h, w = get_aspect_ratio_preserving_size(height=height, width=width, patch_size=patch,
                                                max_patches=int(processor.max_soft_tokens) * k * k,
                                                pooling_kernel_size=k)
        return (h // patch) * (w // patch) // (k * k)


def _config_dicts(cfg: Mapping) -> tuple[dict, dict, dict]:
    raw = dict(cfg.get("config") or {})
    text = {"model_type": "gemma4_text", **(raw.pop("text_config", None) or {})}
    vision = {"model_type": "gemma4_vision", **(raw.pop("vision_config", None) or {})}
    return raw, text, vision


def _vision_config(cfg: Mapping):
    if cfg.get("pretrained"):
        return Gemma4Config.from_pretrained(cfg["pretrained"]).vision_config
    _, _, vision = _config_dicts(cfg)
    return Gemma4Config(vision_config=vision, audio_config=None).vision_config


def build_processor(model_cfg: Mapping | None = None) -> Gemma4ProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer and a Gemma 4
    PIL processor with the vision tower's patch size and pooling kernel. Keys read: ``pretrained``,
    ``tokenizer_dir``, ``config``, ``image_max_soft_tokens`` (one of 70, 140, 280, 560, 1120)."""
    cfg = to_plain(model_cfg) or {}
    vision = _vision_config(cfg)
    return build_processor_bundle(Gemma4ProcessorBundle, cfg, Gemma4ImageProcessorPil, DEFAULT_TOKENIZER_DIR,
                                  patch_size=int(vision.patch_size),
                                  pooling_kernel_size=int(vision.pooling_kernel_size),
                                  max_soft_tokens=int(cfg.get("image_max_soft_tokens") or 280))


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase) -> Gemma4Config:
    """``Gemma4Config`` from ``model_cfg.config`` (text_config / vision_config dicts, top-level fields; no audio),
    with the vocabulary size and every special-token id taken from the tokenizer so they can never disagree."""
    raw, text, vision = _config_dicts(to_plain(model_cfg) or {})
    text.update(vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer),
                pad_token_id=int(tokenizer.pad_token_id), bos_token_id=int(tokenizer.bos_token_id),
                eos_token_id=int(tokenizer.eos_token_id))
    ids = {key: int(tokenizer.convert_tokens_to_ids(token)) for key, token in
           (("boi_token_id", BOI_TOKEN), ("eoi_token_id", EOI_TOKEN), ("image_token_id", IMAGE_SOFT_TOKEN))}
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **ids, **raw)


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Gemma4ForConditionalGeneration:
    """The Gemma 4 model: ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level
    Gemma4Config fields), ``seed`` (default 0), ``dtype`` (default float32).
    """
    return build_hf_model(Gemma4ForConditionalGeneration, model_cfg,
                          sub_model_attention(attn_implementation, vision_shares=("eager", "sdpa")),
                          tiny_config, DEFAULT_TOKENIZER_DIR)


def dummy_media(model) -> dict:
    """``get_image_features`` kwargs for one black image of k x k patches (one soft token); run zero-weighted on
    image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    k, patch = int(vision.pooling_kernel_size), int(vision.patch_size)
    y, x = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
    return {"pixel_values": torch.zeros(1, k * k, 3 * patch * patch),
            "image_position_ids": torch.stack([x.reshape(-1), y.reshape(-1)], -1)[None]}


def cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = ()) -> CostProfile:
    """The engine's profile (``mvp_engine.engine.flops``) of Gemma 4's vision side, one soft token per k x k
    pooled patches, plus what it cannot read from the model: each image's soft tokens are one bidirectional block
    in the sliding layers (``mm_token_type_ids`` 1), and the vision pooler averages k x k patches by a one-hot
    matmul over all of an image's (padded) patches: 2 x hidden / k² FLOPs per (patch, patch) pair of an image, with
    the gradient of the vision states when the vision tower trains."""
    vision = unwrap_model(model).config.vision_config
    k = int(vision.pooling_kernel_size)
    profile = flops.cost_profile(model, unreachable, VISION, patches_per_media_token=k * k)
    pool = 2 * int(vision.hidden_size) // k ** 2
    vision_trains = any(p.requires_grad for n, p in unwrap_model(model).named_parameters()
                        if "vision_tower" in n and n not in set(unreachable))
    return dataclasses.replace(profile, block_field=TYPE_FIELD, block_values=(IMAGE_TYPE,), full_blocks=False,
                               sliding_blocks=True, patch_positions_field=PATCH_POSITIONS,
                               vision_pair=profile.vision_pair + Rate(pool, pool if vision_trains else 0))
