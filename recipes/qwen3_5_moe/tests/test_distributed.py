"""2-rank FSDP2 training of qwen3_5_moe (the fused 3-D expert weights sharded on their expert dim, a linear-attention
layer frozen), its load-balancing loss on, from a pretrained folder, equals 1-rank accumulation, text-only and uneven
micro-batches included (the kit's ``DistributedSuite``; the reduction x sharding matrix is the engine's,
``tests/test_distributed_matrix.py``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_5_moe"
    sharded_freeze = ("model.language_model.layers.0.linear_attn",)  # part of a linear-attention sharding unit
    overrides = ("train.router_aux_loss_coef=0.01",)
