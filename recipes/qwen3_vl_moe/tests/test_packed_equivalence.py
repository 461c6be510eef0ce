"""Packed Qwen3-VL-MoE forwards equal one-by-one forwards (the kit's ``EquivalenceSuite``: logits, loss and gradients,
experts' and routers' included, on eager, sdpa and sdpa_varlen, flash on GPU and its kwargs through sdpa_varlen on
CPU, LoRA, activation checkpointing, the DeepStack mergers reached by the dummy media pass) on a pack of a
timestamped clip, images and text-only samples. A token's MoE output depends on its own top-k experts alone, so
packing cannot move it; the load-balancing term is the engine's (``test_router_balance.py``). Plus the kit's
``ExpertsSuite``: every experts implementation this CPU runs agrees, and the model's own aux loss stays off.

Everything runs on the tiny random model (``conf/model/qwen3_vl_moe_tiny.yaml``, experts on ``grouped_mm``) in fp32
on CPU.
"""

from mvp_engine.engine.testkit.suites import EquivalenceSuite, ExpertsSuite


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen3_vl_moe"


class TestExperts(ExpertsSuite):
    """eager, batched_mm and grouped_mm (the configured one) agree on the packed case; the model's own aux loss
    stays off in the recipe's kwargs."""

    recipe = "qwen3_vl_moe"
