"""2-rank FSDP2 training of glm4v_moe (the fused 3-D expert weights sharded on their expert dim; the router's
``e_score_correction_bias`` buffer moved each step by aux-loss-free balancing), the dummy media pass included, its
load-balancing loss on, from a pretrained folder, equals 1-rank accumulation, text-only and uneven micro-batches
included (the kit's ``DistributedSuite``: losses, grad norms, weights and biases, the step's ``aux_loss`` and
per-layer ``expert_load``; the reduction x sharding matrix is the engine's, ``tests/test_distributed_matrix.py``);
and so does the same run with its experts split over the 2 ranks (``train.expert_parallel_size=2``)."""

import pytest

from mvp_engine.engine.testkit.suites import DistributedSuite

RECIPE = "glm4v_moe"
COVERS = ("EP",)  # for the coverage table (testkit.coverage): the EP 2 check below


class TestDistributed(DistributedSuite):
    recipe = RECIPE
    overrides = ("train.router_aux_loss_coef=0.01", "train.router_bias_update_rate=0.01")

    @pytest.mark.slow
    @pytest.mark.launch
    def test_experts_split_over_two_ranks_train_what_one_rank_accumulating_two_trains(self, pretrained, tmp_path):
        """EP 2 under FSDP2 against the class's 1-rank reference (the suite check's, shared): each rank keeps 2 of
        the 4 experts and routes its own tokens, sigmoid group-top-k steered by the correction bias, so the bias
        must move the same on both ranks (the step's expert counts summed over every rank's real tokens, not the
        tokens an EP rank's experts received): a bias apart on one rank routes its tokens elsewhere and the losses,
        ``aux_loss``, ``expert_load`` and final weights (the saved biases included) part from the reference's
        (checked: rank 1's biases moved against the sign fail the losses; a drift of 1e-3 per step that flips no
        choice in the 4 steps goes unseen, as it changes nothing trained)."""
        out = self.check_two_ranks(pretrained, tmp_path / "two", "fsdp2", ("train.expert_parallel_size=2",))
        assert "expert parallelism: 4 experts per layer split over 2 ranks (2 each)" in out, out
