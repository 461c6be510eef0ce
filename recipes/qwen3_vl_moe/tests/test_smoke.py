"""A few real training steps on the demo data with its clips (the kit's ``SmokeSuite``): falling loss, accounting
that reconciles with the plan, estimated == actual steps. Unpacked (``prepare_padded``) and greedy-packed
(``prepare_packed``) runs; bfd differs from greedy only in the planner, which the engine-level tests cover."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "qwen3_vl_moe"
    packings = (None, "greedy")
