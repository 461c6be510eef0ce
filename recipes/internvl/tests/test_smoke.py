"""A few real InternVL training steps, unpacked and greedy-packed, on the demo data (the kit's ``SmokeSuite``; bfd
differs from greedy only in the planner, which the engine tests cover), under InternVL's ``square`` reduction."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "internvl"
    packings = (None, "greedy")
