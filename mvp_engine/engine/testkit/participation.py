"""Parameter participation: what makes DDP (without an unused-parameter search) and 1-rank == N-rank training hold.

On the recipe's real packed batches (``equivalence_case``):

- the parameters the recipe declares unreachable really receive no gradient from a batch with images (so freezing
  them loses nothing), and after they are frozen every trainable parameter does;
- a text-only batch leaves media parameters without a gradient, and the engine's zero-weighted dummy media pass
  gives each of them an exact zero gradient, without changing the loss or any other gradient.
"""

from __future__ import annotations

import torch

from ..loss import weighted_token_loss
from ..participation import dummy_media_loss, freeze_parameters
from .equivalence import EquivalenceCase, collate_rows


def _backward(case: EquivalenceCase, model, batch: dict, backend: str, dummy: bool) -> float:
    model.zero_grad(set_to_none=True)
    outputs = model(**case.recipe.prepare_packed(batch, model, backend))
    part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token")
    loss = part.weighted_sum / part.weight_total
    if dummy:
        loss = loss + dummy_media_loss(model, case.recipe.dummy_media(model))
    loss.backward()
    return float(loss.detach())


def _without_grad(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


def check_unreachable_parameters_are_unreachable(case: EquivalenceCase, backend: str = "sdpa") -> list[str]:
    """Before freezing: exactly the declared parameters (and no others) get no gradient from an image batch."""
    model = case.recipe.build_model(case.model_cfg, backend)
    declared = set(case.recipe.unreachable_parameters(model))
    _backward(case, model, case.batch, backend, dummy=False)
    missing = _without_grad(model)
    assert missing == declared, (f"parameters without a gradient from an image batch: {sorted(missing - declared)} "
                                 f"undeclared, {sorted(declared - missing)} declared but reached")
    return sorted(declared)


def check_dummy_media_pass(case: EquivalenceCase, backend: str = "sdpa") -> int:
    """After the engine's freezing: an image batch reaches every trainable parameter; a text-only batch does only
    with the dummy pass, which adds exactly zero to the loss and to every gradient. Returns the media tensors."""
    model = case.recipe.build_model(case.model_cfg, backend)
    freeze_parameters(model, [], case.recipe.unreachable_parameters(model))
    _backward(case, model, case.batch, backend, dummy=False)
    assert not _without_grad(model), f"trainable parameters an image batch misses: {sorted(_without_grad(model))}"

    text_only = collate_rows([[s for s in case.samples if s.num_media == 0]], case.pad_token_id)
    plain_loss = _backward(case, model, text_only, backend, dummy=False)
    media_params = _without_grad(model)
    assert media_params, "a text-only batch reached every parameter: the media path was not isolated"
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    dummy_loss = _backward(case, model, text_only, backend, dummy=True)
    assert not _without_grad(model), f"the dummy pass misses {sorted(_without_grad(model))}"
    assert dummy_loss == plain_loss, f"the dummy pass changed the loss: {plain_loss} -> {dummy_loss}"
    for name, param in model.named_parameters():
        if name in media_params:
            assert torch.count_nonzero(param.grad) == 0, f"{name}: the dummy pass gave a non-zero gradient"
        elif name in plain_grads:
            assert torch.equal(param.grad, plain_grads[name]), f"{name}: the dummy pass changed its gradient"
    return len(media_params)
