"""2-process gloo training of llava equals 1-process accumulation, DDP and FSDP2, for every loss reduction, text-only
and uneven micro-batches included (the kit's ``DistributedSuite``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "llava"
