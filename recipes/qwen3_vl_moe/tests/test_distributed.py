"""2-rank FSDP2 training of qwen3_vl_moe, its load-balancing loss on, from a pretrained folder, equals 1-rank
accumulation (the kit's ``DistributedSuite``: losses, grad norms, final weights, and the step's ``aux_loss`` and
per-layer ``expert_load``): the router statistics are summed over both ranks' real tokens and both micro-batches
before any backward (``train.router_aux_loss_scope=step``), so the whole objective, not only the cross-entropy, is
the same on 2 ranks as on 1; and so is the same run with its experts split over the 2 ranks
(``train.expert_parallel_size=2``)."""

import pytest

import mvp_engine.engine.testkit as kit
from mvp_engine.engine.testkit.suites import DistributedSuite

RECIPE = "qwen3_vl_moe"
COVERS = ("EP",)  # for the coverage table (testkit.coverage): the EP 2 check below


class TestDistributed(DistributedSuite):
    recipe = RECIPE
    overrides = ("train.router_aux_loss_coef=0.01",)

    def test_two_ranks_train_what_one_rank_accumulating_two_trains(self, sharding, pretrained, tmp_path):
        """The suite's check, which compares ``aux_loss`` and ``expert_load`` where the runs log them; here they
        must: every step of the 2-rank run logs the aux loss and each MoE layer's load (busiest expert over the
        mean: between 1, balanced, and E / k = 2, collapsed)."""
        super().test_two_ranks_train_what_one_rank_accumulating_two_trains(sharding, pretrained, tmp_path)
        for step in kit.read_metrics(tmp_path / "two"):
            assert 0 < step["aux_loss"] < float("inf")
            assert len(step["expert_load"]) == 2 and all(1.0 <= load <= 2.0 for load in step["expert_load"])

    @pytest.mark.slow
    @pytest.mark.launch
    def test_experts_split_over_two_ranks_train_what_one_rank_accumulating_two_trains(self, pretrained, tmp_path):
        """EP 2 under FSDP2 against the class's 1-rank reference (the suite check's, shared): each rank keeps 2 of
        each MoE layer's 4 experts (transformers' ``Qwen3VLMoeTextExperts``, found and split as Qwen3.5-MoE's are)
        and routes its own tokens to them all-to-all; rank 0 alone reads the pretrained folder and hands each whole
        expert weight over before the split."""
        out = self.check_two_ranks(pretrained, tmp_path / "two", "fsdp2", ("train.expert_parallel_size=2",))
        assert "expert parallelism: 4 experts per layer split over 2 ranks (2 each)" in out, out
