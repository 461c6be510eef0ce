"""2-rank FSDP2 training of Gemma 4 (per-layer-type masks, image blocks in the sliding layers, pre-patchified images
with their positions), from a pretrained folder, equals 1-rank accumulation, text-only and uneven micro-batches
included (the kit's ``DistributedSuite``; the reduction x sharding matrix is the engine's,
``tests/test_distributed_matrix.py``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "gemma4"
    shardings = ("fsdp2", "none")  # its rows cannot split over CP (one global kv head): DDP runs here
