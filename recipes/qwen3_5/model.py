"""Model and processor builders for the Qwen3.5 recipe.

The default is a tiny, seeded, randomly initialised ``Qwen3_5ForConditionalGeneration`` whose config comes from YAML
(``conf/model/qwen3_5_tiny.yaml``: two Gated DeltaNet linear-attention and two full-attention layers) and whose
vocabulary and special-token ids come from the committed tokenizer asset (``assets/tokenizers/qwen3_5``);
``pretrained=<dir>`` loads a ``save_pretrained`` folder. What the Qwen families share (processor bundle,
special-token wiring, dummy media, the encoder) is the family package ``recipes.qwen``.

Qwen3.5's own part is its linear-attention layers: :func:`build_model` makes them take packed-sample boundaries
(``mvp_engine.packing.enable_linear_attention_packing``; transformers 5.24 lets their conv window and recurrent
state run from one packed sample into the next). Images go through ``Qwen2VLImageProcessorPil`` with Qwen3.5's
patch 16 and mean/std 0.5, videos through the family's ``Qwen3VideoProcessor`` (Qwen3-VL's sampling and timestamps).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from mvp_engine.engine.grid_vision import grid_dummy_media
from recipes.qwen import (
    Qwen3VideoProcessor,
    QwenProcessorBundle,
    build_hybrid_model,
    build_qwen_processor,
    qwen_cost_profile,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen3_5"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen3_5Config.model_type,)

# One merged token covers 32x32 pixels (of 2 frames in a clip): every image becomes 4..64 merged tokens, every clip
# 4..64 (clip-wide bounds, as Qwen3.5's video processor counts), 2 frames a second, 4..16 frames.
DEFAULT_IMAGE_PIXELS = (32 * 32 * 4, 32 * 32 * 64)
DEFAULT_VIDEO = Qwen3VideoProcessor(min_pixels=32 * 32 * 2 * 4, max_pixels=32 * 32 * 2 * 64, fps=2.0, min_frames=4,
                                    max_frames=16)
IMAGE_SETTINGS = {"patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5]}  # Qwen3.5's preprocessor_config.json
# The linear-attention layer classes made boundary-aware: Gated DeltaNet's forward (transformers 5.24, read) calls
# exactly the module's causal_conv1d_fn and torch_chunk_gated_delta_rule, which the packing layer wraps.
LINEAR_ATTENTION_LAYERS = (Qwen3_5GatedDeltaNet,)


def build_processor(model_cfg: Mapping | None = None) -> QwenProcessorBundle:
    """Tokenizer, image and video processors (``recipes.qwen.build_qwen_processor``): from
    ``model_cfg.pretrained`` if set, else the asset tokenizer with ``image_min_pixels`` / ``image_max_pixels`` and
    ``video_min_pixels`` / ``video_max_pixels`` (per clip), ``video_fps``, ``video_min_frames``,
    ``video_max_frames`` (defaults: ``DEFAULT_IMAGE_PIXELS``, ``DEFAULT_VIDEO``)."""
    return build_qwen_processor(model_cfg, DEFAULT_TOKENIZER_DIR, image_pixels=DEFAULT_IMAGE_PIXELS,
                                video=DEFAULT_VIDEO, **IMAGE_SETTINGS)


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Qwen3_5ForConditionalGeneration:
    """The Qwen3.5 model, its linear-attention layers made boundary-aware (``recipes.qwen.build_hybrid_model``:
    ``pretrained`` or a tiny seeded init; keys ``pretrained``, ``tokenizer_dir``, ``config``, ``seed``, ``dtype``,
    ``linear_decay_init``)."""
    return build_hybrid_model(Qwen3_5ForConditionalGeneration, Qwen3_5Config, LINEAR_ATTENTION_LAYERS, model_cfg,
                              attn_implementation, DEFAULT_TOKENIZER_DIR)


dummy_media = grid_dummy_media
cost_profile = qwen_cost_profile
