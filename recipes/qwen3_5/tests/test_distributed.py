"""2-process gloo training of qwen3_5 equals 1-process accumulation (the kit's ``DistributedSuite``): the
boundary-aware linear-attention layers under DDP and FSDP2 (part of one frozen), with text-only and uneven
micro-batches; llava's suite covers the other loss reductions."""

from mvp_engine.engine.testkit.suites import DistributedSuite


class TestDistributed(DistributedSuite):
    recipe = "qwen3_5"
    reductions = ("square",)  # bfd packs with images
    sharded_reductions = ("sample",)
    sharded_freeze = ("model.language_model.layers.0.linear_attn",)  # part of a linear-attention sharding unit
