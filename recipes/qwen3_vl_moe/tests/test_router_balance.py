"""The load-balancing loss on the real Qwen3-VL-MoE model, packed against one by one (the equivalence case: two
padded rows holding a clip, images and text-only samples, against each sample alone as its own micro-batch).

transformers' way (``output_router_logits=True``: the model's ``load_balancing_loss_func`` per forward, the step's
micro-batches averaged, as a trainer accumulating them does) gives one aux loss and one router gradient for the pack
and another for the same samples one by one: its expert fractions are those of each forward's rows, a packed row's
padding included (no ``attention_mask`` reaches the model under packing). The engine's
(``mvp_engine.engine.router_balance``, scope ``step``) counts the real tokens of the whole step and gives the same
number and the same router gradients both ways; on one unpadded sample it is the model's own formula."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.router_balance import RouterBalance
from mvp_engine.engine.testkit.suites import shared_case

# packed rows reach the model as cu_seqlens without an attention_mask (the 4-D block mask eager / sdpa take cannot
# go through transformers' aux loss at all: it flattens the mask as [B * L])
BACKEND = "sdpa_varlen"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return shared_case("qwen3_vl_moe", tmp_path_factory)


@pytest.fixture(scope="module")
def steps(case):
    """The packed step (one micro-batch) and the one-by-one step (a micro-batch per sample), with their prepare."""
    return {"packed": ([case.batch], case.recipe.prepare_packed),
            "one by one": ([case.alone(s) for *_, s in case.segments()], case.recipe.prepare_padded)}


def router_grads(model, routers) -> torch.Tensor:
    grads = torch.cat([r.weight.grad.reshape(-1) for r in routers.modules])
    model.zero_grad(set_to_none=True)
    return grads


def transformers_step(case, group, prepare) -> tuple[float, torch.Tensor]:
    model = case.recipe.build_model(case.model_cfg, BACKEND)
    total = 0.0
    for batch in group:
        aux = model(**{**prepare(batch, model, BACKEND), "output_router_logits": True}).aux_loss / len(group)
        aux.backward()
        total += float(aux)
    return total, router_grads(model, case.recipe.moe_routers(model))


def engine_step(case, group, prepare) -> tuple[float, torch.Tensor]:
    """What ``TrainStep`` does with the balance on one rank, coefficient 1."""
    model = case.recipe.build_model(case.model_cfg, BACKEND)
    routers = case.recipe.moe_routers(model)
    balance = RouterBalance(routers, 1.0, "step", reduce=lambda t: t)
    real = lambda batch: batch["pack_segment_ids"] >= 0  # noqa: E731
    balance.begin_step(group, real, lambda batch: model(**prepare(batch, model, BACKEND)), torch.device("cpu"))
    for batch in group:
        with balance.recording(real(batch)):
            model(**prepare(batch, model, BACKEND))
        balance.micro_batch_loss(len(group)).backward()
    return balance.step_metrics()["aux_loss"], router_grads(model, routers)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_transformers_aux_loss_differs_packed_and_one_by_one_the_engines_does_not(case, steps):
    theirs = {name: transformers_step(case, *step) for name, step in steps.items()}
    ours = {name: engine_step(case, *step) for name, step in steps.items()}
    (hf_packed, hf_packed_grads), (hf_alone, hf_alone_grads) = theirs["packed"], theirs["one by one"]
    (packed, packed_grads), (alone, alone_grads) = ours["packed"], ours["one by one"]
    print(f"aux loss: transformers packed {hf_packed:.6f} one by one {hf_alone:.6f} (router grads "
          f"{relative(hf_packed_grads, hf_alone_grads):.1e} apart); engine packed {packed:.6f} one by one "
          f"{alone:.6f} (router grads {relative(packed_grads, alone_grads):.1e} apart)")
    assert abs(hf_packed - hf_alone) > 1e-3 and relative(hf_packed_grads, hf_alone_grads) > 1e-2
    assert abs(packed - alone) <= 1e-5 and relative(packed_grads, alone_grads) <= 1e-5


def test_on_one_unpadded_sample_the_engine_computes_the_models_own_aux_loss(case, steps):
    group, prepare = steps["one by one"]
    one = [group[1]]
    hf, hf_grads = transformers_step(case, one, prepare)
    ours, grads = engine_step(case, one, prepare)
    assert abs(hf - ours) <= 1e-6 and relative(grads, hf_grads) <= 1e-5
