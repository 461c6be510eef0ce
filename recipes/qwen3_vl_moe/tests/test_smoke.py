"""A few real training steps on the demo data with its clips (the kit's ``SmokeSuite``): falling loss, accounting
that reconciles with the plan, estimated == actual steps. Unpacked (``prepare_padded``) and greedy-packed
(``prepare_packed``) runs; bfd differs from greedy only in the planner, which the engine-level tests cover. Plus the
greedy run with the load-balancing loss on, its per-step router metrics."""

import mvp_engine.engine.testkit as kit
from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "qwen3_vl_moe"
    packings = (None, "greedy")


def test_packed_run_with_the_load_balancing_loss_logs_it_every_step(tmp_path):
    """The same greedy-packed smoke run with ``train.router_aux_loss_coef`` on (scope ``step``: a counting forward
    per micro-batch first): the contract holds, and every ``metrics.jsonl`` step carries the aux loss and each MoE
    layer's expert load (busiest expert over the mean: between 1, balanced, and E / k = 2, collapsed)."""
    summary = kit.smoke_run("qwen3_vl_moe", "greedy", tmp_path / "run", ("train.router_aux_loss_coef=0.01",))
    kit.check_smoke_summary(summary)
    metrics = kit.read_metrics(tmp_path / "run")
    assert len(metrics) == summary["actual_steps"]
    for step in metrics:
        assert 0 < step["aux_loss"] < float("inf")
        assert len(step["expert_load"]) == 2 and all(1.0 <= load <= 2.0 for load in step["expert_load"])
