"""A recipe that overrides a suite's check (to assert more) keeps the check's selection markers: pytest reads an
overriding method's own marks only, and a launch-marked 2-rank check without its marker ran in ``make test-fast``'s
lane, where starting processes fails (qwen3_vl_moe's distributed check did)."""

import pytest

from mvp_engine.engine.testkit.suites import inherited_markers


class Check:
    @pytest.mark.slow
    @pytest.mark.launch
    @pytest.mark.parametrize("case", [1])
    def test_runs(self, case):
        """Stands for a suite's marked check."""


class Override(Check):
    def test_runs(self, case):
        """Asserts more, marks nothing."""


class OverrideOfOverride(Override):
    def test_runs(self, case):
        """Two levels down, still the check's markers."""


class Remarked(Check):
    @pytest.mark.launch
    def test_runs(self, case):
        """Marks launch itself; slow is still the check's."""


def test_an_override_gets_the_selection_markers_of_the_check_it_overrides():
    assert inherited_markers(Override, "test_runs") == ["launch", "slow"]
    assert inherited_markers(OverrideOfOverride, "test_runs") == ["launch", "slow"]
    assert inherited_markers(Remarked, "test_runs") == ["slow"]
    assert inherited_markers(Check, "test_runs") == []


def test_a_recipe_override_of_the_distributed_check_gets_its_markers():
    """qwen3_vl_moe overrides the 2-rank check to assert its router metrics and marks nothing itself."""
    from recipes.qwen3_vl_moe.tests.test_distributed import TestDistributed

    assert inherited_markers(TestDistributed, "test_two_ranks_train_what_one_rank_accumulating_two_trains") == [
        "launch", "slow"]


def test_modules_with_launches_or_slow_tests_are_handed_out_first_in_their_own_order():
    """xdist's loadscope deals whole modules in collection order: the long ones go first (conftest)."""
    from types import SimpleNamespace

    from conftest import long_modules_first

    def item(nodeid: str, *markers: str):
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if name in markers else None)

    items = [item("a.py::t1"), item("b.py::t1"), item("b.py::T::t2", "launch"), item("c.py::t1", "slow"),
             item("a.py::t2"), item("d.py::t1")]
    long_modules_first(items)
    assert [i.nodeid for i in items] == ["b.py::t1", "b.py::T::t2", "c.py::t1", "a.py::t1", "a.py::t2", "d.py::t1"]
