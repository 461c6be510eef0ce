"""Context parallelism on qwen3_vl_moe (the kit's ``ContextParallelSuite``): a packed row split over 2 gloo ranks
equals the unsplit row on every CPU backend, and CP = 2 on 2 processes, its load-balancing loss on (each rank counts
the routing of its own chunk of the rows), trains what 1 process trains: losses, aux loss, expert load, weights."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "qwen3_vl_moe"
    overrides = ("train.router_aux_loss_coef=0.01",)
