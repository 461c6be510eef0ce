"""Packed and padded model kwargs for GLM-4.5V: GLM-4.1V's (``recipes/glm4v/packed.py`` says how the model consumes
positions, placeholders and media; the MoE model's code there is the same), with ``output_router_logits=False`` on
every forward (``mvp_engine.engine.experts.without_model_aux_loss``: the engine forms the load-balancing loss over
the step's real tokens, ``router_balance``). The backends are GLM-4.1V's (transformers 5.24 declares flex_attention
for GLM-4.5V, not for GLM-4.1V, whose inputs these are). A token's MoE output depends on that token alone (its top-k
experts), so packed == one-by-one holds as for the dense model."""

from __future__ import annotations

from mvp_engine.engine.experts import without_model_aux_loss
from recipes.glm4v import packed as glm4v_packed

__all__ = ["ATTENTION_BACKENDS", "packed_metadata", "prepare_packed", "prepare_padded"]

ATTENTION_BACKENDS = glm4v_packed.ATTENTION_BACKENDS
packed_metadata = glm4v_packed.packed_metadata
prepare_packed = without_model_aux_loss(glm4v_packed.prepare_packed)
prepare_padded = without_model_aux_loss(glm4v_packed.prepare_padded)
