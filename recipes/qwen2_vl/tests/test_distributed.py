"""2-rank FSDP2 training of qwen2_vl with a frozen vision block and frozen MLP projections, from a pretrained folder,
equals 1-rank accumulation, text-only and uneven micro-batches included (the kit's ``DistributedSuite``; the
reduction x sharding matrix is the engine's, ``tests/test_distributed_matrix.py``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen2_vl"
    reduction = "token"
    packing = "bfd"  # one whole epoch planned before the first step, packs with images
    sharded_freeze = ("model.visual.blocks.0", "*.mlp.up_proj")  # a whole sharding unit, and parts of others
