"""Packed Qwen3.5-MoE forwards equal one-by-one forwards through linear attention, full attention and the MoE blocks
(the kit's ``EquivalenceSuite``: logits, loss and gradients, expert weights and routers included, on packs of
text-only, image and video samples, per backend; with the linear-attention boundaries withheld the kit reports a
difference over 1e-2), plus what is its own: every experts implementation that runs on this CPU computes the same
logits and gradients.

Everything runs on the tiny random model (``conf/model/qwen3_5_moe_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.testkit.suites import EquivalenceSuite, shared_case

TOL = 1e-5


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen3_5_moe"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return shared_case("qwen3_5_moe", tmp_path_factory)


def test_experts_implementations_agree(case):
    """eager (a loop over the experts hit), batched_mm and grouped_mm (the configured one) on the packed case:
    the same logits and expert-weight gradients within 1e-5 (grouped_mm's CPU kernel runs in fp32 here)."""
    results = {}
    for name in ("grouped_mm", "eager", "batched_mm"):
        model = case.recipe.build_model({**case.model_cfg, "experts_implementation": name}, "sdpa")
        logits = model(**case.recipe.prepare_packed(case.batch, model, "sdpa")).logits
        logits.square().mean().backward()
        experts = model.model.language_model.layers[1].mlp.experts
        results[name] = (logits.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    reference = results.pop("grouped_mm")
    for name, tensors in results.items():
        for ours, theirs in zip(reference, tensors):
            scale = theirs.abs().max().clamp(min=1e-12)
            assert ((ours - theirs).abs().max() / scale).item() <= TOL, name


def test_the_models_own_aux_loss_stays_off_under_a_config_that_turns_it_on(case):
    """A checkpoint may set ``output_router_logits``: the recipe's kwargs switch it off, so the packed forward on
    eager runs and forms no aux loss of its own (the engine's is over the step's real tokens); left on, transformers'
    aux loss fails on the 4-D block mask (it flattens the mask as [B * L])."""
    model = case.recipe.build_model(case.model_cfg, "eager").eval()
    model.config.text_config.output_router_logits = True
    kwargs = case.recipe.prepare_packed(case.batch, model, "eager")
    assert kwargs["output_router_logits"] is False
    assert case.recipe.prepare_padded(case.alone(case.samples[0]), model, "eager")["output_router_logits"] is False
    with torch.no_grad():
        assert model(**kwargs).aux_loss is None
        with pytest.raises(RuntimeError, match="must match the size"):
            model(**{**kwargs, "output_router_logits": True})
