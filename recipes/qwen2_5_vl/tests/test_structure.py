"""The qwen2_5_vl recipe has its parts, every packing x attention combination composes, bad configs stop cleanly."""

from mvp_engine.engine.testkit.suites import StructureSuite


class TestStructure(StructureSuite):
    recipe = "qwen2_5_vl"
