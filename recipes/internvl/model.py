"""Model and processor builders for the InternVL recipe (InternVL 3 / 3.5, transformers' ``InternVL`` port).

The default is a tiny, seeded, randomly initialised ``InternVLForConditionalGeneration`` (InternViT tower, pixel
shuffle, the MLP projector, a Qwen2 language model; InternVL 3.5's Qwen3 is ``text_config.model_type: qwen3``) whose
config comes from YAML (``conf/model/internvl_tiny.yaml``) and whose vocabulary and special-token ids come from the
committed tokenizer asset (``assets/tokenizers/internvl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder.

Images go through ``GotOcr2ImageProcessorPil`` (no torchvision) with ``crop_to_patches``: an image becomes 1 tile,
or the ``cols x rows`` tiles of the canvas closest to its aspect ratio (at most ``max_patches``) plus a thumbnail,
each tile the vision tower's ``image_size``; the tiles are stacked ``pixel_values`` ``[tiles, C, H, W]`` and
``image_num_patches`` gives each image's count. Every tile is :func:`tokens_per_tile` context tokens, so an image's
count follows from its header alone (:func:`image_tiles`, transformers' own ``get_number_of_image_patches``).

Attention: the language model runs the configured backend; the tower (each tile alone, no mask) runs sdpa unless
the language model runs eager. InternVL's forward calls ``get_image_features`` without the forward kwargs, so the
language model's varlen kwargs cannot reach the tower.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import InternVLConfig, InternVLForConditionalGeneration, PreTrainedTokenizerBase
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from mvp_engine.engine import flops
from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.kit.mllm.data import CostProfile
from mvp_engine.packing import sub_model_attention, unwrap_model

from .tokens import CONTEXT_IMAGE_TOKEN, IM_END_TOKEN, PAD_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "internvl"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (InternVLConfig.model_type,)
VISION = flops.VisionParts(tower=("vision_tower",), projector=("multi_modal_projector",))


@dataclass
class InternVLProcessorBundle(ProcessorBundle):
    """Tokenizer + ``GotOcr2ImageProcessorPil`` (tiling on); ``image_seq_length`` context tokens per tile."""

    image_token: str = CONTEXT_IMAGE_TOKEN
    image_seq_length: int = 0


def tokens_per_tile(config: InternVLConfig) -> int:
    """Context tokens of one tile: its patches (CLS dropped) after the pixel shuffle's ``downsample_ratio``."""
    vision = config.vision_config
    side = [size // patch for size, patch in zip(vision.image_size, vision.patch_size)]
    return int(side[0] * side[1] * config.downsample_ratio ** 2)


def image_tiles(image_processor: GotOcr2ImageProcessorPil, width: int, height: int) -> int:
    """Tiles ``image_processor`` makes of an image of this size (thumbnail included), from the size alone."""
    return int(image_processor.get_number_of_image_patches(height, width))


def _config_dicts(cfg: Mapping) -> tuple[dict, dict, dict]:
    raw = dict(cfg.get("config") or {})
    text = {"model_type": "qwen2", **(raw.pop("text_config", None) or {})}
    vision = {"model_type": "internvl_vision", **(raw.pop("vision_config", None) or {})}
    return raw, text, vision


def _geometry_config(cfg: Mapping) -> InternVLConfig:
    """The config that fixes the tile size and tokens per tile: the pretrained one, or the tiny one from YAML."""
    if cfg.get("pretrained"):
        return InternVLConfig.from_pretrained(cfg["pretrained"])
    raw, text, vision = _config_dicts(cfg)
    return InternVLConfig(text_config=text, vision_config=vision, **raw)


def build_processor(model_cfg: Mapping | None = None) -> InternVLProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer and a tiling
    GotOcr2 PIL processor whose tile is ``config.vision_config.image_size``. Keys read: ``pretrained``,
    ``tokenizer_dir``, ``config``, ``min_patches`` / ``max_patches`` (tiles per image, thumbnail not counted;
    a pretrained folder's own are kept). Tiling is always on, as ``InternVLProcessor`` has it."""
    cfg = to_plain(model_cfg) or {}
    geometry = _geometry_config(cfg)
    height, width = geometry.vision_config.image_size

    def bundle(tokenizer, image_processor) -> InternVLProcessorBundle:
        return InternVLProcessorBundle(tokenizer, image_processor, image_seq_length=tokens_per_tile(geometry))

    processor = build_processor_bundle(bundle, cfg, GotOcr2ImageProcessorPil, DEFAULT_TOKENIZER_DIR,
                                       size={"height": height, "width": width}, crop_to_patches=True,
                                       min_patches=int(cfg.get("min_patches") or 1),
                                       max_patches=int(cfg.get("max_patches") or 12))
    # InternVLProcessor tiles whatever the saved image-processor config says (its default images_kwargs), and
    # get_number_of_image_patches reads the instance's setting: tiling on here keeps measure == encode == InternVL
    processor.image_processor.crop_to_patches = True
    return processor


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase) -> InternVLConfig:
    """``InternVLConfig`` from ``model_cfg.config`` (text_config / vision_config dicts, top-level fields), with the
    vocabulary size and every special-token id taken from the tokenizer so they can never disagree."""
    raw, text, vision = _config_dicts(to_plain(model_cfg) or {})
    text.update(vocab_size=len(tokenizer), pad_token_id=int(tokenizer.pad_token_id),
                bos_token_id=int(tokenizer.convert_tokens_to_ids(PAD_TOKEN)),
                eos_token_id=int(tokenizer.convert_tokens_to_ids(IM_END_TOKEN)))
    config = InternVLConfig(text_config=text, vision_config=vision,
                            image_token_id=int(tokenizer.convert_tokens_to_ids(CONTEXT_IMAGE_TOKEN)), **raw)
    config.image_seq_length = tokens_per_tile(config)
    return config


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> InternVLForConditionalGeneration:
    """The InternVL model: ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level
    InternVLConfig fields), ``seed`` (default 0), ``dtype`` (default float32).
    """
    return build_hf_model(InternVLForConditionalGeneration, model_cfg, sub_model_attention(attn_implementation),
                          tiny_config, DEFAULT_TOKENIZER_DIR)


def dummy_media(model) -> dict:
    """``get_image_features`` kwargs for one black tile; run zero-weighted on image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    return {"pixel_values": torch.zeros(1, vision.num_channels, *vision.image_size)}


def cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = ()) -> CostProfile:
    """The engine's cost profile (``mvp_engine.engine.flops``) of InternVL's vision side: the stacked items are
    tiles of the tower's fixed size, :func:`tokens_per_tile` context tokens each (the pixel shuffle merges
    1 / ``downsample_ratio``² patches into one), and InternViT's CLS position, attended over by the tower and
    dropped from the tokens by the ``default`` strategy."""
    config = unwrap_model(model).config
    per_token, patches = round(1 / float(config.downsample_ratio) ** 2), flops.fixed_image_patches(config.vision_config)
    cls = config.vision_feature_select_strategy == "default"
    return flops.cost_profile(model, unreachable, VISION, patches_per_media_token=per_token, item_patches=patches,
                              extra_positions_per_item=int(cls), tile_tokens=tokens_per_tile(config))
