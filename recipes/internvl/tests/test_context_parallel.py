"""Context parallelism on InternVL (the kit's ``ContextParallelSuite``): a packed row split over 2 gloo ranks, the cut
inside an image's context-token run, equals the unsplit row on every CPU backend (each rank encodes a share of the
pack's tiles), and CP = 2 on 2 processes trains what 1 process trains."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "internvl"
