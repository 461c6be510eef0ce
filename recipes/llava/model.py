"""Model and processor builders for the LLaVA recipe.

The default is a tiny, seeded, randomly initialised ``LlavaForConditionalGeneration`` (Llama-style language model,
CLIP vision tower, projector) whose config comes from YAML (``conf/model/llava_tiny.yaml``) and whose vocabulary and
special-token ids come from the committed tokenizer asset (``assets/tokenizers/llava``); ``pretrained=<dir>``
loads a ``save_pretrained`` folder (model, tokenizer, image processor). Images go through ``CLIPImageProcessorPil``
(transformers' torchvision-free backend): resize the shortest edge to the vision tower's ``image_size``, centre-crop
to a square, so every image is the same number of tokens, fixed by the model config (:func:`image_token_count`).

Attention: the language model runs the configured backend. The CLIP vision tower sees each image alone, without a
mask, and runs sdpa whenever the language model runs flex_attention, sdpa_varlen or flash: LLaVA's
``get_image_features`` hands *every* extra forward kwarg to the vision tower, so on flash or sdpa_varlen it would
take the language model's ``cu_seq_lens_q/k`` as its own sequence boundaries, and on flex it would only add
compilation for no gain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration, PreTrainedTokenizerBase
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from mvp_engine.engine import flops
from mvp_engine.engine.builders import ProcessorBundle, build_hf_model, build_processor_bundle, to_plain
from mvp_engine.kit.mllm.data import CostProfile
from mvp_engine.packing import sub_model_attention, unwrap_model

from .tokens import IMAGE_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "llava"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (LlavaConfig.model_type,)

VISION = flops.VisionParts(tower=("vision_tower",), projector=("multi_modal_projector",))


@dataclass
class LlavaProcessorBundle(ProcessorBundle):
    """Tokenizer + ``CLIPImageProcessorPil``; ``image_seq_length`` tokens stand for every image."""

    image_token: str = IMAGE_TOKEN
    image_seq_length: int = 0


def image_token_count(config: LlavaConfig) -> int:
    """Tokens the model emits per image: one per patch, plus the CLS token under the ``full`` strategy."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


def _config_dicts(cfg: Mapping) -> tuple[dict, dict, dict]:
    raw = dict(cfg.get("config") or {})
    text = {"model_type": "llama", **(raw.pop("text_config", None) or {})}
    vision = {"model_type": "clip_vision_model", **(raw.pop("vision_config", None) or {})}
    return raw, text, vision


def _geometry_config(cfg: Mapping) -> LlavaConfig:
    """The config that fixes the image size and token count: the pretrained one, or the tiny one from YAML."""
    if cfg.get("pretrained"):
        return LlavaConfig.from_pretrained(cfg["pretrained"])
    raw, text, vision = _config_dicts(cfg)
    return LlavaConfig(text_config=text, vision_config=vision, **raw)


def build_processor(model_cfg: Mapping | None = None) -> LlavaProcessorBundle:
    """Tokenizer and image processor: from ``model_cfg.pretrained`` if set, else the asset tokenizer and a CLIP
    processor sized to ``config.vision_config.image_size``. Keys read: ``pretrained``, ``tokenizer_dir``,
    ``config``."""
    cfg = to_plain(model_cfg) or {}
    geometry = _geometry_config(cfg)
    side = int(geometry.vision_config.image_size)

    def bundle(tokenizer, image_processor) -> LlavaProcessorBundle:
        return LlavaProcessorBundle(tokenizer, image_processor, image_seq_length=image_token_count(geometry))

    return build_processor_bundle(bundle, cfg, CLIPImageProcessorPil, DEFAULT_TOKENIZER_DIR,
                                  size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase) -> LlavaConfig:
    """``LlavaConfig`` from ``model_cfg.config`` (text_config / vision_config dicts, top-level fields), with the
    vocabulary size and the special-token ids taken from the tokenizer so they can never disagree."""
    raw, text, vision = _config_dicts(to_plain(model_cfg) or {})
    text.update(
        vocab_size=len(tokenizer),
        pad_token_id=int(tokenizer.pad_token_id),
        bos_token_id=int(tokenizer.bos_token_id),
        eos_token_id=int(tokenizer.eos_token_id),
    )
    config = LlavaConfig(text_config=text, vision_config=vision,
                         image_token_id=int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)), **raw)
    config.image_seq_length = image_token_count(config)
    return config


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> LlavaForConditionalGeneration:
    """The LLaVA model: ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init.

    Keys read: ``pretrained``, ``tokenizer_dir``, ``config`` (``text_config``, ``vision_config``, top-level
    LlavaConfig fields), ``seed`` (default 0), ``dtype`` (default float32).
    """
    return build_hf_model(LlavaForConditionalGeneration, model_cfg, sub_model_attention(attn_implementation),
                          tiny_config, DEFAULT_TOKENIZER_DIR)


def dummy_media(model) -> dict:
    """``get_image_features`` kwargs for one black image at the vision tower's size; run zero-weighted on
    image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


def unreachable_parameters(model) -> list[str]:
    """The CLIP layers after ``vision_feature_layer`` and its ``post_layernorm``: LLaVA reads an earlier hidden
    state, so no forward reaches them (the engine freezes them, or DDP would wait for their gradients)."""
    inner = unwrap_model(model)
    layers = inner.config.vision_feature_layer
    depth = inner.config.vision_config.num_hidden_layers
    # hidden_states[k] is the output of layer k - 1 (k = 0: the embeddings), so layers k.. are never read
    used = max(k % (depth + 1) for k in (layers if isinstance(layers, (list, tuple)) else [layers]))
    unused_prefixes = [f"encoder.layers.{i}." for i in range(used, depth)] + ["post_layernorm."]
    return [name for name, _ in inner.named_parameters()
            if ".vision_tower." in f".{name}" and any(p in name for p in unused_prefixes)]


def cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = ()) -> CostProfile:
    """The engine's cost profile (``mvp_engine.engine.flops``) of LLaVA's vision side: every image the tower's fixed
    patch count, one token each, and a CLIP tower's CLS position, which the tower attends over but the ``default``
    strategy drops from the image's tokens (under ``full`` it is one of them)."""
    config = unwrap_model(model).config
    vision = config.vision_config
    cls = "clip" in vision.model_type and config.vision_feature_select_strategy == "default"
    return flops.cost_profile(model, unreachable, VISION, item_patches=flops.fixed_image_patches(vision),
                              extra_positions_per_item=int(cls))
