"""Context parallelism on Gemma 3 (the kit's ``ContextParallelSuite``): a packed row split over 2 gloo ranks equals
the unsplit row on every CPU backend (per-layer-type masks, bidirectional image blocks cut between the ranks), and
CP = 2 on 2 processes trains what 1 process trains."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "gemma3"
