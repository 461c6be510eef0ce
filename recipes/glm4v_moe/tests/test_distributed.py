"""2-rank FSDP2 training of glm4v_moe (the fused 3-D expert weights sharded on their expert dim; the router's
``e_score_correction_bias`` buffer moved each step by aux-loss-free balancing), the dummy media pass included, its
load-balancing loss on, from a pretrained folder, equals 1-rank accumulation, text-only and uneven micro-batches
included (the kit's ``DistributedSuite``: losses, grad norms, weights and biases, the step's ``aux_loss`` and
per-layer ``expert_load``; the reduction x sharding matrix is the engine's, ``tests/test_distributed_matrix.py``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "glm4v_moe"
    overrides = ("train.router_aux_loss_coef=0.01", "train.router_bias_update_rate=0.01")
