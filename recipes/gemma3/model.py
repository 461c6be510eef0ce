"""Model and processor builders for the Gemma 3 recipe.

The default is a tiny, seeded, randomly initialised ``Gemma3ForConditionalGeneration`` (Gemma 3 text model with
sliding-window and full-attention layers, SigLIP vision tower, the average-pooling projector) whose config comes from
YAML (``conf/model/gemma3_tiny.yaml``) and whose vocabulary and special-token ids come from the committed tokenizer
asset (``assets/tokenizers/gemma3``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. Images go through
``Gemma3ImageProcessorPil`` (no torchvision): resized to the vision tower's square ``image_size``, pan-and-scan off,
so every image is ``mm_tokens_per_image`` soft tokens, fixed by the config.

Attention: the language model runs the configured backend; the SigLIP tower (each image alone, no mask) runs sdpa
unless the language model runs eager. Gemma 3's ``get_image_features`` passes no forward kwargs to the tower, so the
language model's varlen kwargs cannot reach it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PreTrainedTokenizerBase
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from mvp_engine.engine import flops
from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.kit.mllm.data import CostProfile
from mvp_engine.packing import sub_model_attention, unwrap_model
from recipes.gemma.tokens import BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "gemma3"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Gemma3Config.model_type,)
VISION = flops.VisionParts(tower=("vision_tower",), projector=("multi_modal_projector",))


@dataclass
class Gemma3ProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Gemma3ImageProcessorPil``; ``image_seq_length`` soft tokens stand for every image."""

    image_token: str = IMAGE_SOFT_TOKEN
    image_seq_length: int = 0


def _config_dicts(cfg: Mapping) -> tuple[dict, dict, dict]:
    raw = dict(cfg.get("config") or {})
    text = {"model_type": "gemma3_text", **(raw.pop("text_config", None) or {})}
    vision = {"model_type": "siglip_vision_model", **(raw.pop("vision_config", None) or {})}
    return raw, text, vision


def _geometry_config(cfg: Mapping) -> Gemma3Config:
    """The config that fixes the image size and token count: the pretrained one, or the tiny one from YAML."""
    if cfg.get("pretrained"):
        return Gemma3Config.from_pretrained(cfg["pretrained"])
    raw, text, vision = _config_dicts(cfg)
    return Gemma3Config(text_config=text, vision_config=vision, **raw)


def build_processor(model_cfg: Mapping | None = None) -> Gemma3ProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer and a Gemma 3
    PIL processor sized to ``config.vision_config.image_size``. Keys read: ``pretrained``, ``tokenizer_dir``,
    ``config``."""
    cfg = to_plain(model_cfg) or {}
    geometry = _geometry_config(cfg)
    side = int(geometry.vision_config.image_size)

    def bundle(tokenizer, image_processor) -> Gemma3ProcessorBundle:
        return Gemma3ProcessorBundle(tokenizer, image_processor, image_seq_length=int(geometry.mm_tokens_per_image))

    return build_processor_bundle(bundle, cfg, Gemma3ImageProcessorPil, DEFAULT_TOKENIZER_DIR,
                                  size={"height": side, "width": side}, do_pan_and_scan=False)


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase) -> Gemma3Config:
    """``Gemma3Config`` from ``model_cfg.config`` (text_config / vision_config dicts, top-level fields), with the
    vocabulary size and every special-token id taken from the tokenizer so they can never disagree."""
    raw, text, vision = _config_dicts(to_plain(model_cfg) or {})
    text.update(vocab_size=len(tokenizer), pad_token_id=int(tokenizer.pad_token_id),
                bos_token_id=int(tokenizer.bos_token_id), eos_token_id=int(tokenizer.eos_token_id))
    ids = {key: int(tokenizer.convert_tokens_to_ids(token)) for key, token in
           (("boi_token_index", BOI_TOKEN), ("eoi_token_index", EOI_TOKEN), ("image_token_index", IMAGE_SOFT_TOKEN))}
    return Gemma3Config(text_config=text, vision_config=vision, **ids, **raw)


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Gemma3ForConditionalGeneration:
    """The Gemma 3 model: ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level
    Gemma3Config fields), ``seed`` (default 0), ``dtype`` (default float32).
    """
    return build_hf_model(Gemma3ForConditionalGeneration, model_cfg, sub_model_attention(attn_implementation),
                          tiny_config, DEFAULT_TOKENIZER_DIR)


def dummy_media(model) -> dict:
    """``get_image_features`` kwargs for one black image at the vision tower's size; run zero-weighted on
    image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


def cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = ()) -> CostProfile:
    """The engine's cost profile (``mvp_engine.engine.flops``) of Gemma 3's vision side: every image the SigLIP
    tower's fixed patch count, average-pooled into ``mm_tokens_per_image`` soft tokens."""
    config = unwrap_model(model).config
    patches = flops.fixed_image_patches(config.vision_config)
    return flops.cost_profile(model, unreachable, VISION, item_patches=patches,
                              patches_per_media_token=patches // int(config.mm_tokens_per_image))
