"""Context parallelism on glm4v_moe (the kit's ``ContextParallelSuite``): a packed row split over 2 gloo ranks equals
the unsplit row on every CPU backend (the MoE layer included), and CP = 2 on 2 processes, its load-balancing
loss and bias updates on, trains what 1 process trains (aux loss, expert load and the routers' correction biases
included)."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "glm4v_moe"
    overrides = ("train.router_aux_loss_coef=0.01", "train.router_bias_update_rate=0.01")
