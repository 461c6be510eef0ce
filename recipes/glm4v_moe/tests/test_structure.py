"""The glm4v_moe recipe has its parts, every packing x attention combination composes, bad configs stop cleanly."""

from mvp_engine.engine.testkit.suites import StructureSuite


class TestStructure(StructureSuite):
    recipe = "glm4v_moe"
