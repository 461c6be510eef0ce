"""A few real training steps of the tiny GLM-4.5V on the demo data with its clips (the kit's ``SmokeSuite``): falling
loss, accounting that reconciles with the plan, estimated == actual steps. Greedy-packed only: the padded baseline's
inputs are GLM-4.1V's own (``recipes/glm4v/tests/test_smoke.py``), and the MoE layer routes each token alone, packed or
not (``test_packed_equivalence.py``).

The run trains with the load-balancing loss on (``train.router_aux_loss_coef``; scope ``step``: a counting forward per
micro-batch first), and every ``metrics.jsonl`` step carries the aux loss and each MoE layer's expert load; the
routers' correction bias moves every step (aux-loss-free balancing, ``train.router_bias_update_rate``)."""

import torch

import mvp_engine.engine.testkit as kit
from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "glm4v_moe"
    packings = ("greedy",)
    overrides = ("train.router_aux_loss_coef=0.01", "train.router_bias_update_rate=0.01")

    def test_smoke_training(self, packing, tmp_path):
        """The suite's run and checks, then its router metrics: a finite aux loss every step, and per MoE layer
        (1) the busiest expert's load over the mean between 1 (balanced) and E / k = 2 (collapsed)."""
        super().test_smoke_training(packing, tmp_path)
        metrics = kit.read_metrics(tmp_path / "run")
        assert metrics and len(metrics) == kit.read_summary(tmp_path / "run")["actual_steps"]
        for step in metrics:
            assert 0 < step["aux_loss"] < float("inf")
            assert len(step["expert_load"]) == 1 and all(1.0 <= load <= 2.0 for load in step["expert_load"])
        # aux-loss-free balancing on (train.router_bias_update_rate=0.01): the saved bias moved, a whole number of
        # 0.01 steps (one per optimizer step) within the steps taken
        bias = kit.final_weights(tmp_path / "run")["model.language_model.layers.1.mlp.gate.e_score_correction_bias"]
        steps = (bias / 0.01).double()
        assert bool(bias.any()) and torch.allclose(steps, steps.round(), atol=1e-3)
        assert float(steps.abs().max()) <= len(metrics)
