"""2-process gloo training of Gemma 4 (per-layer-type masks, image blocks in the sliding layers, pre-patchified
images with their positions) equals 1-process accumulation, DDP and FSDP2 (the kit's ``DistributedSuite``; the loss
reductions are the engine's and run on llava)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "gemma4"
    reductions = ("token",)
    sharded_reductions = ("sample",)
