"""Packed and padded model kwargs for Qwen3-VL-MoE (transformers 5.24): Qwen3-VL's (``recipes/qwen3_vl/packed.py``
says how the model consumes positions, media and DeepStack features; the MoE model's code there is the same), plus
``output_router_logits=False`` on every forward.

Why the flag: with ``output_router_logits`` on (a checkpoint's config may set it) the model would record every
layer's router logits and form its own load-balancing loss over the forward's rows, a packed row's padding
included (no ``attention_mask`` reaches it under packing). The engine forms that loss itself, over the optimizer
step's real tokens (``mvp_engine.engine.router_balance``), from the routers it hooks; the model's own is never
computed (``mvp_engine.engine.experts.without_model_aux_loss``). The family's ``packed_metadata`` is named here, so
the run's collator computes the positions in the loader's workers as for Qwen3-VL. A token's MoE output depends on
that token alone (its top-k experts), so packed == one-by-one holds as for the dense model.
"""

from __future__ import annotations

from mvp_engine.engine.experts import without_model_aux_loss
from recipes.qwen.packed import packed_metadata
from recipes.qwen3_vl import packed as qwen3_vl_packed

__all__ = ["ATTENTION_BACKENDS", "packed_metadata", "prepare_packed", "prepare_padded"]

ATTENTION_BACKENDS = qwen3_vl_packed.ATTENTION_BACKENDS
prepare_packed = without_model_aux_loss(qwen3_vl_packed.prepare_packed)
prepare_padded = without_model_aux_loss(qwen3_vl_packed.prepare_padded)
