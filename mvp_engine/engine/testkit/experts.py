"""Checks of a mixture-of-experts recipe beyond packed == one-by-one (``suites.ExpertsSuite``): its experts compute the
same under every ``experts_implementation`` this machine runs, and the model's own load-balancing loss stays off in
the recipe's kwargs (the engine forms the loss over the step's real tokens, ``router_balance.py``)."""

from __future__ import annotations

import torch

from ..experts import CPU_IMPLEMENTATIONS, expert_parameters
from .equivalence import EquivalenceCase

TOL = 1e-5


def check_experts_implementations_agree(case: EquivalenceCase, implementations=CPU_IMPLEMENTATIONS,
                                        tol: float = TOL) -> dict[str, float]:
    """The packed case's logits and every expert weight's gradient under each of ``implementations`` against the
    first (eager loops over the experts hit, batched_mm gathers each token's weights, grouped_mm sorts and runs
    torch's grouped GEMM): within ``tol`` of the largest value. Returns the largest relative difference per
    implementation."""
    results = {}
    for name in implementations:
        model = case.recipe.build_model({**case.model_cfg, "experts_implementation": name}, "sdpa")
        logits = model(**case.recipe.prepare_packed(case.batch, model, "sdpa")).logits
        logits.square().mean().backward()
        results[name] = [logits.detach()] + [p.grad.clone() for _, p in expert_parameters(model)]
    first, *others = implementations
    reference, differences = results[first], {}
    for name in others:
        differences[name] = max(float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-12))
                                for ours, theirs in zip(results[name], reference))
        assert differences[name] <= tol, f"experts_implementation={name} differs from {first} by {differences[name]}"
    return differences


def check_model_aux_loss_stays_off(case: EquivalenceCase) -> None:
    """A checkpoint's config may set ``output_router_logits``: the recipe's packed and padded kwargs switch it off,
    so the model forms no aux loss of its own (per forward, a packed row's padding counted); left on, transformers'
    ``load_balancing_loss_func`` cannot even take the 4-D block mask eager packs with (it flattens the mask as
    ``[B * L]``)."""
    model = case.recipe.build_model(case.model_cfg, "eager").eval()
    model.config.get_text_config().output_router_logits = True
    kwargs = case.recipe.prepare_packed(case.batch, model, "eager")
    assert kwargs["output_router_logits"] is False
    assert case.recipe.prepare_padded(case.alone(case.samples[0]), model, "eager")["output_router_logits"] is False
    with torch.no_grad():
        assert model(**kwargs).aux_loss is None
        try:
            model(**{**kwargs, "output_router_logits": True})
        except RuntimeError as err:
            assert "must match the size" in str(err), err
        else:
            raise AssertionError("transformers' aux loss took the 4-D packed mask: re-read what the model does with it")
