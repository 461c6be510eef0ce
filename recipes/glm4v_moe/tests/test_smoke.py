"""A few real training steps of the tiny GLM-4.5V on the demo data with its clips (the kit's ``SmokeSuite``): falling
loss, accounting that reconciles with the plan, estimated == actual steps. Greedy-packed only: the padded baseline's
inputs are GLM-4.1V's own (``recipes/glm4v/tests/test_smoke.py``), and the MoE layer routes each token alone, packed or
not (``test_packed_equivalence.py``)."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "glm4v_moe"
    packings = ("greedy",)
