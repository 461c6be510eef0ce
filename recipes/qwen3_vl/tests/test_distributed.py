"""2-rank FSDP2 training of qwen3_vl, DeepStack's dummy media pass included, from a pretrained folder, equals 1-rank
accumulation, text-only and uneven micro-batches included (the kit's ``DistributedSuite``; the reduction x sharding
matrix is the engine's, ``tests/test_distributed_matrix.py``)."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_vl"
