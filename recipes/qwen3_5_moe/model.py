"""Model builder for the Qwen3.5-MoE recipe.

Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``) is Qwen3.5 with every decoder layer's MLP a sparse MoE block: a
top-k softmax router over ``num_experts`` routed experts (3-D fused weights) plus one sigmoid-gated shared expert.
Everything else is Qwen3.5's and reused from it: the tokenizer asset, processor and encoder (``recipes.qwen3_5``),
packed inputs and per-segment M-RoPE, and the Gated DeltaNet layers made boundary-aware (the family's
``recipes.qwen.build_hybrid_model``; Qwen3.5-MoE's linear-attention module calls the same two functions,
``mvp_engine.packing.linear_attention``).

The default is a tiny, seeded, random init from ``conf/model/qwen3_5_moe_tiny.yaml`` (one linear-attention and one
full-attention layer, 4 experts, top-2); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The experts compute
with ``model.experts_implementation`` (``mvp_engine.engine.experts``; ``grouped_mm``, transformers' default, runs on
this CPU in fp32).

Routers: ``moe_routers`` is the engine's reading of what the model declares (``router_balance.recorded_routers``: the
``Qwen3_5MoeTopKRouter`` modules, softmax top-k as the model routes, E and k, the config's ``router_aux_loss_coef``
where ``output_router_logits`` is on): the engine forms the load-balancing loss over the optimizer step's real
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from mvp_engine.engine.builders import to_plain
from mvp_engine.engine.experts import set_experts_implementation
from mvp_engine.engine.router_balance import recorded_routers
from recipes.qwen import build_hybrid_model
from recipes.qwen3_5.model import DEFAULT_TOKENIZER_DIR, build_processor, cost_profile, dummy_media

__all__ = ["MODEL_TYPES", "build_model", "build_processor", "cost_profile", "dummy_media", "moe_routers"]

# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen3_5MoeConfig.model_type,)
# Qwen3.5-MoE's linear-attention layer, read: its forward is Qwen3.5's (same module-level conv1d and delta rule)
LINEAR_ATTENTION_LAYERS = (Qwen3_5MoeGatedDeltaNet,)


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa") -> Qwen3_5MoeForConditionalGeneration:
    """The Qwen3.5-MoE model, its linear-attention layers boundary-aware (``recipes.qwen.build_hybrid_model``: keys
    ``pretrained``, ``tokenizer_dir``, ``config``, ``seed``, ``dtype``, ``linear_decay_init``), its experts
    computed by ``experts_implementation`` (null: transformers' choice)."""
    model = build_hybrid_model(Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig, LINEAR_ATTENTION_LAYERS,
                               model_cfg, attn_implementation, DEFAULT_TOKENIZER_DIR)
    return set_experts_implementation(model, (to_plain(model_cfg) or {}).get("experts_implementation"))


moe_routers = recorded_routers
