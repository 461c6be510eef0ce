"""2-process gloo training of qwen2_vl equals 1-process accumulation, DDP and FSDP2 (with a frozen vision block and
frozen MLP projections), text-only and uneven micro-batches included (the kit's ``DistributedSuite``; llava's suite
covers the other loss reductions)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen2_vl"
    reductions = ("square",)  # bfd packs with images; llava runs every reduction
    sharded_reductions = ("token",)
    sharded_freeze = ("model.visual.blocks.0", "*.mlp.up_proj")  # a whole sharding unit, and parts of others
