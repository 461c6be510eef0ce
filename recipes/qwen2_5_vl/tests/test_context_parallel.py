"""Context parallelism on qwen2_5_vl (the kit's ``ContextParallelSuite``): a packed row with a clip split over 2 gloo
ranks equals the unsplit row on every CPU backend (positions, second_per_grid_ts included, computed on the whole row
before the split; each rank's share of the media through the windowed tower), and CP = 2 on 2 processes trains what
1 process trains."""

from mvp_engine.engine.testkit.suites import ContextParallelSuite


class TestContextParallel(ContextParallelSuite):
    recipe = "qwen2_5_vl"
