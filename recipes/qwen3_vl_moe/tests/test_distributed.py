"""2-rank FSDP2 training of qwen3_vl_moe, its load-balancing loss on, from a pretrained folder, equals 1-rank
accumulation (the kit's ``DistributedSuite``: losses, grad norms, final weights, and the step's ``aux_loss`` and
per-layer ``expert_load``): the router statistics are summed over both ranks' real tokens and both micro-batches
before any backward (``train.router_aux_loss_scope=step``), so the whole objective, not only the cross-entropy, is
the same on 2 ranks as on 1."""

import mvp_engine.engine.testkit as kit
from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_vl_moe"
    overrides = ("train.router_aux_loss_coef=0.01",)

    def test_two_ranks_train_what_one_rank_accumulating_two_trains(self, sharding, pretrained, tmp_path):
        """The suite's check, which compares ``aux_loss`` and ``expert_load`` where the runs log them; here they
        must: every step of the 2-rank run logs the aux loss and each MoE layer's load (busiest expert over the
        mean: between 1, balanced, and E / k = 2, collapsed)."""
        super().test_two_ranks_train_what_one_rank_accumulating_two_trains(sharding, pretrained, tmp_path)
        for step in kit.read_metrics(tmp_path / "two"):
            assert 0 < step["aux_loss"] < float("inf")
            assert len(step["expert_load"]) == 2 and all(1.0 <= load <= 2.0 for load in step["expert_load"])
