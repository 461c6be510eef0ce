"""Context parallelism on qwen3_5_moe (the kit's ``ContextParallelSuite``): a packed row split over 2 gloo ranks equals
the unsplit row on every CPU backend (linear-attention layers and MoE blocks included), and CP = 2 on 2 processes,
its load-balancing loss on, trains what 1 process trains (aux loss and expert load included)."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "qwen3_5_moe"
    overrides = ("train.router_aux_loss_coef=0.01",)
