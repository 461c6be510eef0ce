"""Model builder for the GLM-4.5V recipe.

GLM-4.5V (``Glm4vMoeForConditionalGeneration``, transformers 5.24) is GLM-4.1V's architecture with a DeepSeek-V3
style MoE language model: after ``first_k_dense_replace`` dense layers, each MLP is a sigmoid router choosing
``num_experts_per_tok`` of ``n_routed_experts`` experts inside the ``topk_group`` best of ``n_group`` expert groups,
with an ``e_score_correction_bias`` buffer added to the scores for the choice only (DeepSeek's aux-loss-free
balancing; transformers does not update it), plus ``n_shared_experts`` shared experts on every token.

Its placeholders, rope, vision tower and processors are GLM-4.1V's, so the recipe takes them from ``recipes.glm4v``:
:class:`Glm4vMoeMixedMediaForConditionalGeneration` is transformers' class on the same mixed-media placeholder fix
(``recipes.glm4v.model.MixedMediaPlaceholders``: video placeholders carry ``config.video_token_id``, so a pack of
images and clips scatters each feature onto its own token), with GLM-4.5V's weights, config and names.

The default is a tiny, seeded, random init from ``conf/model/glm4v_moe_tiny.yaml`` (one dense and one MoE layer, 4
experts in 2 groups, top-2); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The experts compute with
``model.experts_implementation`` (``mvp_engine.engine.experts``).

Routers (:func:`moe_routers`, the engine's ``router_balance``): the ``Glm4vMoeTextTopkRouter`` modules, the
coefficient ``router_aux_loss_coef`` where the config's ``output_router_logits`` is on (GLM-4.5V's: 0.0001, off by
default), read as GLM routes (:func:`sigmoid_routing`): the experts each token really ran (group-limited, steered by
the correction bias) and the per-token normalised sigmoid scores, DeepSeek-V3's balance-loss form. transformers'
own aux loss for this model (``load_balancing_loss_func``) takes a softmax top-k of the router logits, which are not
the experts the tokens ran; the engine sums the statistics over the optimizer step's real tokens either way.
GLM-4.5V balances mainly without that loss, by the routers' ``e_score_correction_bias`` (which transformers never
updates): ``train.router_bias_update_rate`` moves it once per optimizer step from the step's expert counts over every
rank's real tokens (``router_balance``), the same on every rank; it is a buffer of the model, saved with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeModel, Glm4vMoePreTrainedModel, Glm4vMoeTextModel

from mvp_engine.engine.builders import to_plain
from mvp_engine.engine.experts import set_experts_implementation
from mvp_engine.engine.router_balance import Routers, recorded_routers
from recipes.glm4v.model import MixedMediaPlaceholders, build_glm_model, build_processor, cost_profile, dummy_media

__all__ = ["MODEL_TYPES", "build_model", "build_processor", "cost_profile", "dummy_media", "moe_routers"]

# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Glm4vMoeConfig.model_type,)


class Glm4vMoeMixedMediaModel(MixedMediaPlaceholders, Glm4vMoeModel):
    """``Glm4vMoeModel`` whose video placeholders are ``config.video_token_id`` in ``input_ids``."""


class Glm4vMoeMixedMediaForConditionalGeneration(Glm4vMoeForConditionalGeneration):
    """``Glm4vMoeForConditionalGeneration`` on :class:`Glm4vMoeMixedMediaModel`: the same weights and config."""

    # transformers decides whether a class may switch its experts implementation by reading the source of the
    # class's module for "@use_experts_implementation" (modeling_utils._can_set_experts_implementation): this
    # module defines no experts, its experts are transformers' Glm4vMoeTextExperts, which carry the decorator
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config: Glm4vMoeConfig):
        Glm4vMoePreTrainedModel.__init__(self, config)
        self.model = Glm4vMoeMixedMediaModel(config)
        self.lm_head = torch.nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.num_experts = config.text_config.num_local_experts
        self.num_experts_per_tok = config.text_config.num_experts_per_tok
        self.post_init()


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa"):
    """:class:`Glm4vMoeMixedMediaForConditionalGeneration` (``recipes.glm4v.model.build_glm_model``: keys
    ``pretrained``, ``tokenizer_dir``, ``config``, ``seed``, ``dtype``), its experts computed by
    ``experts_implementation`` (null: transformers' choice)."""
    model = build_glm_model(Glm4vMoeMixedMediaForConditionalGeneration, Glm4vMoeConfig, model_cfg,
                            attn_implementation)
    return set_experts_implementation(model, (to_plain(model_cfg) or {}).get("experts_implementation"))


def sigmoid_routing(output, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``Glm4vMoeTextTopkRouter`` output ``(logits, weights, chosen)`` as the balance loss reads it: each token's
    sigmoid scores normalised to sum 1 (fp32, in the graph) and the ``top_k`` experts the router chose."""
    logits, _, chosen = output
    scores = logits.float().sigmoid()
    return scores / scores.sum(-1, keepdim=True), chosen


def moe_routers(model) -> Routers | None:
    """The routers of the model's language model (``Glm4vMoeTextModel`` declares the recorder, the conditional
    generation class does not), read by :func:`sigmoid_routing`, their ``e_score_correction_bias`` the buffer
    aux-loss-free balancing moves (``train.router_bias_update_rate``)."""
    text = next((m for m in model.modules() if isinstance(m, Glm4vMoeTextModel)), None)
    routers = None if text is None else recorded_routers(text, read=sigmoid_routing)
    return None if routers is None else replace(routers, bias="e_score_correction_bias")
