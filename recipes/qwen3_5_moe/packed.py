"""Packed and padded model kwargs for Qwen3.5-MoE: Qwen3.5's (``recipes/qwen3_5/packed.py`` says how the hybrid model
consumes positions, masks and linear-attention boundaries; the MoE model's code there is the same, and so are the
backends: transformers 5.24 declares no flex_attention for it either), with ``output_router_logits=False`` on every
forward (``mvp_engine.engine.experts.without_model_aux_loss``: the engine forms the load-balancing loss over the
step's real tokens, ``router_balance``). A token's MoE output depends on that token alone (its top-k experts), so
packed == one-by-one holds as for the dense model."""

from __future__ import annotations

from mvp_engine.engine.experts import without_model_aux_loss
from recipes.qwen.packed import packed_metadata
from recipes.qwen3_5 import packed as qwen3_5_packed

__all__ = ["ATTENTION_BACKENDS", "packed_metadata", "prepare_packed", "prepare_padded"]

ATTENTION_BACKENDS = qwen3_5_packed.ATTENTION_BACKENDS
prepare_packed = without_model_aux_loss(qwen3_5_packed.prepare_packed)
prepare_padded = without_model_aux_loss(qwen3_5_packed.prepare_padded)
