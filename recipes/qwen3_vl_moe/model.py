"""Model and processor builders for the Qwen3-VL-MoE recipe.

``Qwen3VLMoeForConditionalGeneration`` (transformers 5.24) is Qwen3-VL with every decoder layer's MLP (or every
``decoder_sparse_step``-th, less ``mlp_only_layers``) a sparse MoE block: a softmax top-k router
(``Qwen3VLMoeTextTopKRouter``, the top-k weights renormalised) over ``num_experts`` experts held as 3-D parameters.
The checkpoints ship Qwen3-VL's tokenizer and processors, so the tokenizer asset, image and video processing and the
encoder are Qwen3-VL's (``recipes.qwen.qwen3_vl``, ``recipes.qwen.Qwen3SampleEncoder``), and so are the vision tower
(DeepStack), its dummy media and cost profile.

The default is a tiny, seeded, random init from ``conf/model/qwen3_vl_moe_tiny.yaml`` (the tiny Qwen3-VL with 4
experts, top-2, in both layers); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The experts compute with
``model.experts_implementation`` (``mvp_engine.engine.experts``; ``grouped_mm`` runs on this CPU in fp32).

Routers: ``moe_routers`` is the engine's reading of what the model declares (``router_balance.recorded_routers``:
the ``Qwen3VLMoeTextTopKRouter`` modules, E and k, the config's ``router_aux_loss_coef`` where
``output_router_logits`` is on): the engine forms the load-balancing loss over the optimizer step's real tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from mvp_engine.engine.builders import to_plain
from mvp_engine.engine.experts import set_experts_implementation
from mvp_engine.engine.grid_vision import grid_dummy_media
from mvp_engine.engine.router_balance import recorded_routers
from recipes.qwen import build_qwen_model, qwen_cost_profile
from recipes.qwen.qwen3_vl import QWEN3_VL_TOKENIZER_DIR, build_qwen3_vl_processor

# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen3VLMoeConfig.model_type,)

build_processor = build_qwen3_vl_processor


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Qwen3VLMoeForConditionalGeneration:
    """``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init (``recipes.qwen.build_qwen_model``:
    keys ``pretrained``, ``tokenizer_dir``, ``config``, ``seed``, ``dtype``), its experts computed by
    ``experts_implementation`` (null: transformers' choice)."""
    model = build_qwen_model(Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig, model_cfg, attn_implementation,
                             QWEN3_VL_TOKENIZER_DIR, vision_out="out_hidden_size")
    return set_experts_implementation(model, (to_plain(model_cfg) or {}).get("experts_implementation"))


dummy_media = grid_dummy_media
cost_profile = qwen_cost_profile
moe_routers = recorded_routers
