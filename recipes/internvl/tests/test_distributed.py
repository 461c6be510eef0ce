"""2-process gloo training of InternVL (stacked tiles, 1-D positions per segment) equals 1-process accumulation, DDP
and FSDP2 (the kit's ``DistributedSuite``; the loss reductions are the engine's and run on llava)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "internvl"
    reductions = ("square",)
    sharded_reductions = ("square",)
