"""Model and processor builders for the Qwen3-VL recipe.

The default is a tiny, seeded, randomly initialised ``Qwen3VLForConditionalGeneration`` from YAML
(``conf/model/qwen3_vl_tiny.yaml``: its vision tower sets ``deepstack_visual_indexes`` inside its own depth, so the
DeepStack mergers run) with vocabulary and special-token ids from the committed tokenizer asset
(``assets/tokenizers/qwen3_vl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The builders are the
Qwen families' shared ones (the family package ``recipes.qwen``); the tokenizer asset, image and video processing
are Qwen3-VL's, shared with the MoE recipe (``recipes.qwen.qwen3_vl``).
"""

from __future__ import annotations

from functools import partial

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from mvp_engine.engine.grid_vision import grid_dummy_media
from recipes.qwen import build_qwen_model, qwen_cost_profile
from recipes.qwen.qwen3_vl import QWEN3_VL_TOKENIZER_DIR, build_qwen3_vl_processor

# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen3VLConfig.model_type,)

# Keys read: the processor's (recipes.qwen.qwen3_vl) and for the model config (text_config, vision_config, top-level
# Qwen3VLConfig fields), seed, dtype.
build_processor = build_qwen3_vl_processor
build_model = partial(build_qwen_model, Qwen3VLForConditionalGeneration, Qwen3VLConfig,
                      tokenizer_dir=QWEN3_VL_TOKENIZER_DIR, vision_out="out_hidden_size")
dummy_media = grid_dummy_media
cost_profile = qwen_cost_profile
