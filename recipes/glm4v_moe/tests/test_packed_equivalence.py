"""Packed GLM-4.5V forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``: logits, loss and gradients,
expert weights and the sigmoid router included, on eager, sdpa and sdpa_varlen, flash on GPU and its kwargs through
sdpa_varlen on CPU, LoRA, activation checkpointing, the dummy media pass) on a pack of a timestamped clip, an image
and a text-only sample beside a pack of images and text; plus what is GLM-4.5V's own: the recipe's model class gives
transformers' own ``Glm4vMoeForConditionalGeneration`` logits wherever that one runs (which fails on a pack of an
image and a clip), the group-limited routing really limits (every token's experts inside its best group, the
correction bias steering the choice but not the weights), and every experts implementation that runs on this CPU
computes the same logits and gradients.

Everything runs on the tiny random model (``conf/model/glm4v_moe_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4vMoeForConditionalGeneration

from mvp_engine.engine.testing import collate_rows
from mvp_engine.engine.testkit.suites import EquivalenceSuite, ExpertsSuite, shared_case
from recipes.glm4v.packed import prepare_packed, prepare_padded


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "glm4v_moe"


class TestExperts(ExpertsSuite):
    """eager, batched_mm and grouped_mm (the configured one) agree on the packed case; the model's own aux loss
    stays off in the recipe's kwargs."""

    recipe = "glm4v_moe"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return shared_case("glm4v_moe", tmp_path_factory)


def moe_layer(model):
    """The tiny config's MoE block (layer 0 is dense: ``first_k_dense_replace`` 1)."""
    return model.model.language_model.layers[1].mlp


def test_the_recipe_model_is_transformers_glm4v_moe_wherever_that_runs(case):
    """Sample by sample (an image, three images, a clip, text): transformers' own model with the same weights and
    buffers, fed the processor's ids (frames as image placeholders), gives the recipe model's padded logits exactly;
    on the packed row of an image and a clip it refuses (its image count includes the frames)."""
    ours = case.recipe.build_model(case.model_cfg, "sdpa").eval()
    theirs = Glm4vMoeForConditionalGeneration(ours.config).eval()
    theirs.load_state_dict(ours.state_dict())
    pad = case.recipe.pad_token_id(case.processor)
    with torch.no_grad():
        for sample in case.samples:
            batch = collate_rows([[sample]], pad)
            kwargs = prepare_padded(batch, ours, "sdpa")
            native = theirs(**{**kwargs, "input_ids": batch["input_ids"]}).logits
            assert torch.equal(native, ours(**kwargs).logits), sample.sample_id
        mixed = collate_rows([case.rows[1]], pad)
        kwargs = prepare_packed(mixed, ours, "sdpa")
        assert torch.isfinite(ours(**kwargs).logits).all()
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            theirs(**{**kwargs, "input_ids": mixed["input_ids"]})


def test_group_limited_routing_and_the_correction_bias(case):
    """The tiny router (4 experts in 2 groups, top-2 from the best group): every token's two experts share a
    group; a large ``e_score_correction_bias`` on one expert puts it in every token's choice while the routing
    weights stay the unbiased sigmoid scores, renormalised."""
    gate = moe_layer(case.recipe.build_model(case.model_cfg, "sdpa")).gate
    hidden = torch.randn(64, gate.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, chosen = gate(hidden)
        per_group = gate.num_experts // gate.num_group
        assert torch.equal(chosen.min(-1).values // per_group, chosen.max(-1).values // per_group)
        gate.e_score_correction_bias[3] = 10.0
        _, biased_weights, biased = gate(hidden)
    assert bool((biased == 3).any(-1).all())
    expected = logits.sigmoid().gather(1, biased)
    assert torch.allclose(biased_weights, expected / expected.sum(-1, keepdim=True), atol=1e-6)
    assert not torch.equal(biased.sort(-1).values, chosen.sort(-1).values)
