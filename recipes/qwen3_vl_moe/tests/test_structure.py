"""The qwen3_vl_moe recipe has its parts, every packing x attention combination composes, bad configs stop cleanly."""

from mvp_engine.engine.testkit.suites import StructureSuite


class TestStructure(StructureSuite):
    recipe = "qwen3_vl_moe"
