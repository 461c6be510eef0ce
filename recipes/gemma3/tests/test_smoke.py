"""A few real Gemma 3 training steps, unpacked (the model's own masks) and greedy-packed (the per-layer-type masks), on
the demo data (the kit's ``SmokeSuite``; bfd differs from greedy only in the planner, which the engine tests cover)."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "gemma3"
    packings = (None, "greedy")
