"""2-rank FSDP2 training of qwen3_vl_moe, its load-balancing loss on, from a pretrained folder, equals 1-rank
accumulation (the kit's ``DistributedSuite``: losses, grad norms, final weights, and the step's ``aux_loss`` and
per-layer ``expert_load``): the router statistics are summed over both ranks' real tokens and both micro-batches
before any backward (``train.router_aux_loss_scope=step``), so the whole objective, not only the cross-entropy, is
the same on 2 ranks as on 1."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_vl_moe"
    overrides = ("train.router_aux_loss_coef=0.01",)
