"""2-process gloo training of qwen2_5_vl equals 1-process accumulation, DDP (unpacked) and FSDP2 (greedy packs) with
a frozen windowed vision block, text-only and uneven micro-batches included (the kit's ``DistributedSuite``; llava's
suite covers the other loss reductions)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen2_5_vl"
    reductions = ("token",)
    sharded_reductions = ("sample",)
    sharded_freeze = ("model.visual.blocks.0",)  # the windowed block: a whole sharding unit
