"""Packed Qwen3.5-MoE forwards equal one-by-one forwards through linear attention, full attention and the MoE blocks
(the kit's ``EquivalenceSuite``: logits, loss and gradients, expert weights and routers included, on packs of
text-only, image and video samples, per backend; with the linear-attention boundaries withheld the kit reports a
difference over 1e-2), plus the kit's ``ExpertsSuite``: every experts implementation that runs on this CPU
computes the same logits and expert gradients, and the model's own aux loss stays off.

Everything runs on the tiny random model (``conf/model/qwen3_5_moe_tiny.yaml``) in fp32 on CPU.
"""

from mvp_engine.engine.testkit.suites import EquivalenceSuite, ExpertsSuite


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen3_5_moe"


class TestExperts(ExpertsSuite):
    """eager, batched_mm and grouped_mm (the configured one) agree on the packed case; the model's own aux loss
    stays off in the recipe's kwargs."""

    recipe = "qwen3_5_moe"
