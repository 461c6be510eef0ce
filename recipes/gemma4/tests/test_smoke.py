"""A few real Gemma 4 training steps per packing mode on the demo data (the kit's ``SmokeSuite``)."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "gemma4"
