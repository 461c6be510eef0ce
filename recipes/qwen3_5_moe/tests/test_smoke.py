"""A few real training steps of the tiny Qwen3.5-MoE on the demo data with its clips (the kit's ``SmokeSuite``):
falling loss, accounting that reconciles with the plan, estimated == actual steps. Greedy-packed only: the padded
baseline's linear-attention path is Qwen3.5's own (``recipes/qwen3_5/tests/test_smoke.py``), and the MoE blocks route
each token alone, packed or not (``test_packed_equivalence.py``)."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "qwen3_5_moe"
    packings = ("greedy",)
