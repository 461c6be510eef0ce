"""Aux-loss-free balancing of GLM-4.5V's routers (``train.router_bias_update_rate``, ``router_balance.RouterBalance
.end_step``): each optimizer step moves every router's ``e_score_correction_bias`` by ``rate * sign(mean load - expert
load)`` from the step's expert counts over real tokens, counted here independently from the routers' own choices;
the same bias whether the step's samples came packed or one by one (padding never counted); the bias is a
persistent buffer, so the model's saved state carries it; routers without a correction bias refuse the rate in one
line. The 2-rank FSDP2 and CP runs with the update on (``test_distributed.py``, ``test_context_parallel.py``) compare
the final weights, the biases included, with one process's."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.router_balance import build_router_balance
from mvp_engine.engine.testkit import compose_config, load_recipe
from mvp_engine.engine.testkit.suites import shared_case

RATE = 0.01


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return shared_case("glm4v_moe", tmp_path_factory)


def biases_after_a_step(case, batches, prepare, chosen: list | None = None) -> torch.Tensor:
    """One step's counting (no backward needed: the counts are not differentiated) over ``batches``, then
    ``end_step``; ``chosen`` collects each router call's (chosen experts, real-token mask)."""
    model = case.recipe.build_model(case.model_cfg, "sdpa").eval()
    routers = case.recipe.moe_routers(model)
    balance = build_router_balance(routers, None, "step", lambda t: t, RATE)
    real = None
    handles = [m.register_forward_hook(lambda m, a, out: chosen.append((out[2], real))) for m in routers.modules
               ] if chosen is not None else []
    balance.begin_step(batches, lambda b: b["pack_segment_ids"] >= 0, lambda b: None, torch.device("cpu"))
    with torch.no_grad():
        for batch in batches:
            real = (batch["pack_segment_ids"] >= 0).reshape(-1)
            with balance.recording(batch["pack_segment_ids"] >= 0):
                model(**prepare(batch, model, "sdpa"))
            assert balance.micro_batch_loss(len(batches)) is None  # coefficient 0 (the config's): no aux term
    for handle in handles:
        handle.remove()
    balance.end_step()
    return torch.stack([getattr(m, routers.bias).detach().clone() for m in routers.modules])


def test_one_step_moves_each_bias_by_the_sign_of_its_load_gap(case):
    chosen = []
    biases = biases_after_a_step(case, [case.batch], case.recipe.prepare_packed, chosen)
    (experts, real), = chosen  # one MoE layer, one forward
    counts = torch.bincount(experts[real].reshape(-1), minlength=4).double()
    assert int(counts.sum()) == 2 * int(real.sum()) < 2 * real.numel()  # top-2 of the real tokens, padding left out
    expected = RATE * torch.sign(counts.mean() - counts)
    assert bool((expected != 0).any())
    assert torch.equal(biases[0], expected.float())


def test_packed_and_one_by_one_steps_move_the_biases_alike(case):
    packed = biases_after_a_step(case, [case.batch], case.recipe.prepare_packed)
    alone = biases_after_a_step(case, [case.alone(s) for s in case.samples], case.recipe.prepare_padded)
    assert torch.equal(packed, alone)


def test_the_bias_is_saved_with_the_model_and_refused_where_there_is_none(case, tmp_path):
    model = case.recipe.build_model(case.model_cfg, "sdpa")
    routers = case.recipe.moe_routers(model)
    with torch.no_grad():
        routers.modules[0].e_score_correction_bias.copy_(torch.tensor([0.03, -0.01, 0.0, -0.02]))
    model.save_pretrained(tmp_path)
    loaded = case.recipe.build_model(compose_config("glm4v_moe", [f"model.pretrained={tmp_path}"]).model, "sdpa")
    assert torch.equal(case.recipe.moe_routers(loaded).modules[0].e_score_correction_bias,
                       routers.modules[0].e_score_correction_bias)
    qwen = load_recipe("qwen3_5_moe")
    qwen_routers = qwen.moe_routers(qwen.build_model(compose_config("qwen3_5_moe").model, "sdpa"))
    with pytest.raises(ConfigError, match="^train.router_bias_update_rate=0.01 needs routers with a correction bias: "
                                          "Qwen3_5MoeTopKRouter has none"):
        build_router_balance(qwen_routers, None, "step", lambda t: t, RATE)
