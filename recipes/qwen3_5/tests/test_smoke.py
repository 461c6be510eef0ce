"""Real training steps on the demo data through the hybrid model's boundary-aware linear layers (the kit's
``SmokeSuite``): falling loss, accounting that reconciles with the plan, estimated == actual steps. Greedy only: the
planners and the padded baseline are model-free and run by the other recipes' smoke tests (the padded forward of
this model is checked against one-by-one in ``test_packed_equivalence.py``)."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "qwen3_5"
    packings = ("greedy",)
