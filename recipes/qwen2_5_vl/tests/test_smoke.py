"""A few real training steps on the demo data (the kit's ``SmokeSuite``): falling loss, accounting that reconciles
with the plan, estimated == actual steps, on greedy packs (``prepare_packed``). The unpacked path
(``prepare_padded``) is the reference of every equivalence check and trains in the distributed suite; bfd differs
from greedy only in the planner, which the engine-level tests cover."""

from mvp_engine.engine.testkit.suites import SmokeSuite


class TestSmoke(SmokeSuite):
    recipe = "qwen2_5_vl"
    packings = ("greedy",)
