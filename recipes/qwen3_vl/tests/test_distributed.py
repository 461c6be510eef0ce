"""2-process gloo training of qwen3_vl equals 1-process accumulation, DDP and FSDP2, DeepStack's dummy media pass
included (the kit's ``DistributedSuite``; llava's suite covers the other loss reductions)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_vl"
    reductions = ("token",)
    sharded_reductions = ("sample",)
