"""The cost model counts a mixture-of-experts model's ACTIVE experts: MFU and ``packing.balance=compute`` rest on it.

Why: a MoE layer holds E experts and runs k of them per token (plus its shared experts); counting all E would inflate
MFU E/k-fold (64x for Qwen3.5-397B-A17B's top-8 of 512) and weigh packs wrongly. Checked on each MoE recipe's tiny
model against hand formulas from its config: one more active expert per token adds 2 x 3 x hidden x moe_intermediate
FLOPs per MoE layer (gate, up and down projections), more experts at the same top-k add only the router's
2 x hidden per expert; and torch's FLOP counter, given the kit's formula for ``aten._grouped_mm`` (the experts'
kernel, which the counter does not know), counts a forward and backward under ``grouped_mm`` exactly as it counts
the same model under ``eager`` (the experts as plain matmuls). The executed-vs-counted check of every recipe,
these included, is ``tests/test_flops.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mvp_engine.engine.flops import recipe_cost_profile
from mvp_engine.engine.loss import weighted_token_loss
from mvp_engine.engine.testkit import compose_config, load_recipe
from mvp_engine.engine.testkit.flops import _grouped_mm_flop
from mvp_engine.engine.testkit.suites import shared_case

# recipe -> its text config's key for the number of routed experts
MOE_RECIPES = {"qwen3_5_moe": "num_experts", "qwen3_vl_moe": "num_experts", "glm4v_moe": "n_routed_experts"}


def lm_token_forward(name: str, **text: int) -> tuple[int, object]:
    """The language model's forward FLOPs per token of the recipe's tiny model with ``text`` config overrides."""
    recipe = load_recipe(name)
    cfg = compose_config(name, [f"model.config.text_config.{key}={value}" for key, value in text.items()])
    model = recipe.build_model(cfg.model, "eager")
    return recipe_cost_profile(recipe, model).lm_token.forward, model.config.get_text_config()


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_active_experts_and_routers_cost_what_the_config_says(name):
    experts_key = MOE_RECIPES[name]
    top2, text = lm_token_forward(name)
    assert text.num_experts_per_tok == 2 and getattr(text, experts_key) == 4
    moe_layers = text.num_hidden_layers - getattr(text, "first_k_dense_replace", 0)
    hidden, intermediate = text.hidden_size, text.moe_intermediate_size
    top1, _ = lm_token_forward(name, num_experts_per_tok=1)
    assert top2 - top1 == moe_layers * 2 * 3 * hidden * intermediate
    wider, _ = lm_token_forward(name, **{experts_key: 8})  # 8 experts, still top-2: only the routers grow
    assert wider - top2 == moe_layers * 2 * hidden * 4


def test_the_grouped_mm_formula_counts_what_eager_experts_count(tmp_path_factory):
    """One recipe: the formula is the kernel's, whichever model calls it."""
    case = shared_case("glm4v_moe", tmp_path_factory)
    counted = {}
    for implementation in ("eager", "grouped_mm"):
        model = case.recipe.build_model({**case.model_cfg, "experts_implementation": implementation}, "eager")
        counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flop})
        with counter:
            logits = model(**case.recipe.prepare_packed(case.batch, model, "eager")).logits
            part = weighted_token_loss(logits, case.batch["labels"], case.batch["pack_segment_ids"], "token")
            (part.weighted_sum / part.weight_total).backward()
        counted[implementation] = counter.get_flop_counts()["Global"]
    eager, grouped = counted["eager"], counted["grouped_mm"]
    assert grouped.get(torch.ops.aten._grouped_mm, 0) > 0 and torch.ops.aten._grouped_mm not in eager
    assert sum(grouped.values()) == sum(eager.values())
