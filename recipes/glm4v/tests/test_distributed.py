"""2-process gloo training of glm4v equals 1-process accumulation, DDP and FSDP2, the dummy media pass included (the
kit's ``DistributedSuite``; llava's suite covers the other loss reductions)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "glm4v"
    reductions = ("token",)
    sharded_reductions = ("sample",)
