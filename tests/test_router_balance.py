"""The engine's router statistics and load-balancing loss (``mvp_engine/engine/router_balance.py``) on a tiny fake
mixture-of-experts model: padding never counted, the step-scope loss and its router gradients the same for one packed
micro-batch as for its samples one by one under accumulation (the micro-batch scope not: what it does not promise),
an activation-checkpointed router layer exact, and the refusals. The real model's check (transformers' own aux loss
per micro-batch differs packed vs one-by-one, the engine's equals) is ``recipes/qwen3_vl_moe/tests``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mvp_engine.engine.config import ConfigError, TrainSpec
from mvp_engine.engine.router_balance import RouterBalance, Routers, aux_loss, build_router_balance, expert_load

EXPERTS, TOP_K, HIDDEN = 4, 2, 8


class Router(torch.nn.Module):
    """transformers' router convention: logits first in the output."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))

    def forward(self, hidden):
        return (torch.nn.functional.linear(hidden.reshape(-1, HIDDEN), self.weight),)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.mix = Router(), torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden):
        gate = torch.softmax(self.router(hidden)[0], -1)[:, :1].reshape(*hidden.shape[:-1], 1)
        return hidden + gate * torch.tanh(self.mix(hidden))


class FakeMoE(torch.nn.Module):
    """Token-local layers (no attention): a token's routing depends on the token alone, as packed rows need."""

    def __init__(self, recompute: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers, self.recompute = torch.nn.Embedding(50, HIDDEN), torch.nn.ModuleList(
            [Layer(), Layer()]), recompute

    def forward(self, ids):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = checkpoint(layer, hidden, use_reentrant=False) if self.recompute else layer(hidden)
        return hidden

    def routers(self) -> Routers:
        return Routers(tuple(layer.router for layer in self.layers), EXPERTS, TOP_K)


SAMPLES = [torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 29)]


def packed():
    """Two rows: samples 0 and 1, then sample 2, each row ending in padding (segment -1)."""
    ids = torch.zeros(2, 11, dtype=torch.long)
    segments = torch.full((2, 11), -1)
    ids[0, :5], ids[0, 5:8], ids[1, :9] = SAMPLES
    segments[0, :5], segments[0, 5:8], segments[1, :9] = 0, 1, 0
    return [{"ids": ids, "segments": segments}]


def one_by_one():
    return [{"ids": s[None], "segments": torch.zeros(1, len(s), dtype=torch.long)} for s in SAMPLES]


def train_step(model, group, scope="step", coef=0.1, per_layer=False):
    """What ``TrainStep`` does with a balance: count (scope step), then per micro-batch record, add the share,
    backward. Returns the step's metrics and the router weights' gradients."""
    balance = RouterBalance(model.routers(), coef, scope, reduce=lambda t: t, per_layer=per_layer)
    real = lambda batch: batch["segments"] >= 0  # noqa: E731
    balance.begin_step(group, real, lambda batch: model(batch["ids"]), torch.device("cpu"))
    model.zero_grad()
    for batch in group:
        with balance.recording(real(batch)):
            model(batch["ids"])
        share = balance.micro_batch_loss(len(group))
        if share is not None:
            share.backward()
    metrics = balance.step_metrics()
    balance.remove()
    return metrics, [layer.router.weight.grad for layer in model.layers]


def test_padding_is_never_counted():
    """The counts of the padded pack are those of its real tokens alone: 17 tokens x top-2 per layer."""
    model = FakeMoE()
    balance = RouterBalance(model.routers(), 0.0, "step", reduce=lambda t: t)
    batch = packed()[0]
    with balance.recording(batch["segments"] >= 0):
        model(batch["ids"])
    sums = balance._recorded()
    assert sums.tokens == 17 and sums.counts.sum(1).tolist() == [34.0, 34.0]
    with balance.recording(torch.ones_like(batch["segments"], dtype=torch.bool)):
        model(batch["ids"])
    assert balance._recorded().counts.sum(1).tolist() == [44.0, 44.0]  # what counting the padding would give


@pytest.mark.parametrize("recompute,per_layer", [(False, False), (True, False), (False, True)])
def test_step_scope_is_the_same_packed_and_one_by_one(recompute, per_layer):
    """The packed micro-batch and the three samples accumulated give one aux loss and one router gradient; so
    does an activation-checkpointed model (the hooks record in the forward, never in the recomputation), and so does
    the per-layer form."""
    (packed_metrics, packed_grads), (alone_metrics, alone_grads) = (
        train_step(FakeMoE(recompute), group, per_layer=per_layer) for group in (packed(), one_by_one()))
    assert abs(packed_metrics["aux_loss"] - alone_metrics["aux_loss"]) <= 1e-6
    assert packed_metrics["expert_load"] == alone_metrics["expert_load"]
    for a, b in zip(packed_grads, alone_grads):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-6 * a.abs().max()
    reference = train_step(FakeMoE(), packed(), per_layer=per_layer)[1]
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(packed_grads, reference))


def test_micro_batch_scope_is_exact_within_a_micro_batch_only():
    """Scope micro_batch forms f per micro-batch: the packed step (one micro-batch) differs from the samples
    accumulated one by one, as its docstring says; on one micro-batch it is the step scope."""
    packed_metrics, packed_grads = train_step(FakeMoE(), packed(), "micro_batch")
    alone_metrics, _ = train_step(FakeMoE(), one_by_one(), "micro_batch")
    assert abs(packed_metrics["aux_loss"] - alone_metrics["aux_loss"]) > 1e-3
    step_metrics, step_grads = train_step(FakeMoE(), packed(), "step")
    assert abs(packed_metrics["aux_loss"] - step_metrics["aux_loss"]) <= 1e-7
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(packed_grads, step_grads))


def test_coefficient_zero_adds_nothing_and_still_reports_the_load():
    metrics, grads = train_step(FakeMoE(), packed(), coef=0.0)
    assert grads == [None, None]  # no loss term: nothing reached the routers
    assert metrics["aux_loss"] == pytest.approx(train_step(FakeMoE(), packed())[0]["aux_loss"], rel=1e-9)
    assert len(metrics["expert_load"]) == 2 and all(1.0 <= v <= EXPERTS / TOP_K for v in metrics["expert_load"])


def test_aux_loss_and_load_formulas():
    """One balanced layer: f = k / E each, P = 1 / E each: aux = E * E * (k / E) * (1 / E) = k; load 1."""
    counts = torch.full((1, EXPERTS), 3.0 * TOP_K / EXPERTS, dtype=torch.float64)
    probs = torch.full((1, EXPERTS), 3.0 / EXPERTS)
    assert float(aux_loss(counts, probs, torch.tensor(3.0, dtype=torch.float64))) == pytest.approx(TOP_K)
    assert expert_load(torch.tensor([[6.0, 0.0, 0.0, 2.0]])) == [3.0]



def test_the_per_layer_form_sees_layers_collapsed_onto_different_experts():
    """Two tokens, layer 0 sending both to experts 0 and 1, layer 1 to experts 2 and 3 (probabilities alike): pooled
    over the layers every expert looks equally used (aux = k, the balanced value), per layer each router is collapsed
    (aux = E, its most unbalanced value); on one layer the two forms are one."""
    counts = torch.tensor([[2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0]], dtype=torch.float64)
    probs, tokens = counts.float() / TOP_K, torch.tensor(2.0, dtype=torch.float64)
    assert float(aux_loss(counts, probs, tokens)) == pytest.approx(TOP_K)
    assert float(aux_loss(counts, probs, tokens, per_layer=True)) == pytest.approx(EXPERTS)
    assert float(aux_loss(counts[:1], probs[:1], tokens, per_layer=True)) == pytest.approx(
        float(aux_loss(counts[:1], probs[:1], tokens)))


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"train.router_aux_loss_coef=-0.1 is invalid"):
        TrainSpec(router_aux_loss_coef=-0.1)
    with pytest.raises(ConfigError, match=r"train.router_aux_loss_scope='epoch' is invalid"):
        TrainSpec(router_aux_loss_scope="epoch")
    with pytest.raises(ConfigError, match=r"train.router_aux_loss_layers='sum' is invalid"):
        TrainSpec(router_aux_loss_layers="sum")
    with pytest.raises(ConfigError, match=r"train.router_aux_loss_coef=0.01 needs a mixture-of-experts model"):
        build_router_balance(None, 0.01, "step", reduce=lambda t: t)
    assert build_router_balance(None, None, "step", reduce=lambda t: t) is None
    model = FakeMoE()
    balance = RouterBalance(Routers((model.layers[0].router,), EXPERTS, TOP_K), 0.1, "step", reduce=lambda t: t)
    with pytest.raises(RuntimeError, match=r"router 0 \(Router\) routed 22 rows in a forward of 5 tokens"):
        with balance.recording(torch.ones(1, 5, dtype=torch.bool)):
            model(packed()[0]["ids"])
