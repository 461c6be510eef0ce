"""2-process gloo training of Gemma 3 (per-layer-type masks, bidirectional image blocks) equals 1-process
accumulation, DDP and FSDP2 (the kit's ``DistributedSuite``; the loss reductions are the engine's and run on llava)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "gemma3"
    reductions = ("sample",)
    sharded_reductions = ("square",)
