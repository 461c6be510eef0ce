"""The feature x recipe coverage table in ``skills/`` is the one the tests imply today
(``mvp_engine.engine.testkit.coverage``), and every recipe carries the contracts every recipe must carry."""

import sys

from mvp_engine.engine.testkit.coverage import REFUSED, TABLE_PATH, coverage_markdown, covered

EVERY_RECIPE = ("packed == one-by-one", "encoder == processor", "LoRA", "recompute", "FSDP2", "CP", "DDP")


def test_the_committed_table_is_the_generated_one():
    assert TABLE_PATH.read_text() == coverage_markdown(), (
        f"{TABLE_PATH} is stale: run python -m mvp_engine.engine.testkit.coverage")


def test_every_recipe_carries_every_contract_or_a_tested_refusal():
    table = covered()
    gaps = [f"{recipe}: {feature}" for recipe in sorted(table) for feature in EVERY_RECIPE
            if not table[recipe][feature]]
    assert not gaps, gaps
    refused = {(r, f) for r, row in table.items() for f, where in row.items() if any(REFUSED in w for w in where)}
    assert refused == {("gemma4", "CP")}, refused  # one global key/value head: Ulysses cannot split it


def test_the_reading_sees_a_suite_subclass_and_an_engine_module(tmp_path, monkeypatch):
    """A test that could not fail proves nothing: the reading must pick up what a new test module declares."""
    from mvp_engine.engine.testkit import coverage

    (tmp_path / "coverage_probe.py").write_text(
        "from mvp_engine.engine.testkit.suites import ContextParallelSuite, DistributedSuite\n"
        'RECIPE = "llava"\nCOVERS = ("elastic",)\nREFUSES = ("eval",)\n'
        'class TestCP(ContextParallelSuite):\n    recipe = "llava"\n'
        'class TestDistributed(DistributedSuite):\n    recipe = "llava"\n    shardings = ("fsdp2", "none")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(coverage, "_takes_video", lambda name: False)
    try:
        table = coverage.covered(["coverage_probe"])
    finally:
        sys.modules.pop("coverage_probe", None)
    assert table["llava"]["elastic"] == ["coverage_probe"] and table["llava"]["eval"] == ["refused: coverage_probe"]
    assert table["llava"]["CP"] == ["ContextParallelSuite"]
    assert table["llava"]["DDP"] == ["ContextParallelSuite", "DistributedSuite"]
    assert table["llava"]["FSDP2"] == ["DistributedSuite"]
