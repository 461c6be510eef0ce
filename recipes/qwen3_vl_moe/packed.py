"""Packed and padded model kwargs for Qwen3-VL-MoE (transformers 5.24): Qwen3-VL's (``recipes/qwen3_vl/packed.py``
says how the model consumes positions, media and DeepStack features; the MoE model's code there is the same), plus
``output_router_logits=False`` on every forward.

Why the flag: with ``output_router_logits`` on (a checkpoint's config may set it) the model would record every
layer's router logits and form its own load-balancing loss over the forward's rows, a packed row's padding
included (no ``attention_mask`` reaches it under packing). The engine forms that loss itself, over the optimizer
step's real tokens (``mvp_engine.engine.router_balance``), from the routers it hooks; the model's own is never
computed. A token's MoE output depends on that token alone (its top-k experts), so packed == one-by-one holds as for
the dense model.
"""

from __future__ import annotations

from recipes.qwen import packed as qwen_packed
from recipes.qwen.qwen3_vl import QWEN3_VL_ATTENTION_BACKENDS as ATTENTION_BACKENDS  # flex refused at load time

__all__ = ["ATTENTION_BACKENDS", "prepare_packed", "prepare_padded"]

NO_MODEL_AUX = {"output_router_logits": False}


def prepare_packed(batch: dict, model, attn_implementation: str) -> dict:
    return {**qwen_packed.prepare_packed(batch, model, attn_implementation, supported=ATTENTION_BACKENDS),
            **NO_MODEL_AUX}


def prepare_padded(batch: dict, model, attn_implementation: str) -> dict:
    return {**qwen_packed.prepare_padded(batch, model, attn_implementation), **NO_MODEL_AUX}
