"""Shared test setup: ``gpu`` tests skip cleanly on machines without CUDA and are the only ones that see it: every
other test runs as on a CPU machine (``VLM_PACKING_DEVICE=cpu``, ``mvp_engine/engine/device.py``), so the suite's
CPU claims hold on a GPU machine too. Every test session measures into its own cache folder (so do the processes
tests launch, which inherit the environment): a user's ``~/.cache/vlm_packing`` is never read or written by the
tests. The session ends with how many trainings ran and how (launched interpreters, pooled multi-rank runs, forked
runs a test kills, in-process runs; summed over pytest-xdist's workers): the suite's cost is counted, not guessed."""

import os
import tempfile

import pytest
import torch

from mvp_engine.engine.device import DEVICE_ENV

os.environ["VLM_PACKING_CACHE"] = tempfile.mkdtemp(prefix="vlm_packing_cache_")
# every test computes on one torch thread, as every launched and pooled rank does (LAUNCH_ENV): on a 2-core machine
# that the suite shares with its own processes (DataLoader workers, pooled ranks, launches, the fork server's
# imports) two OpenMP threads wait on each other whenever a core is taken, and in-process tests ran 2-3x slower
# (measured: recipes/llava/tests + smoke/equivalence/engine files, 206 and 325 s on two threads, 116 and 114 s on
# one); a test's numbers then do not depend on the cores it found free
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """A test not marked ``gpu`` runs on the CPU: engine runs (in-process, pooled, launched: they inherit the
    environment) pick the CPU, gloo and CPU-only backends, as on a machine without CUDA."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv(DEVICE_ENV, "cpu")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers
def pytest_collection_modifyitems(config, items):
    from mvp_engine.engine.testkit.suites import inherited_markers

    for item in items:
        if getattr(item, "cls", None) is not None:
            for name in inherited_markers(item.cls, item.originalname):
                item.add_marker(name)
    long_modules_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def long_modules_first(items) -> None:
    """Modules that start processes or hold slow tests run first. Why: pytest-xdist's loadscope hands whole modules
    to the workers in collection order, so a long module collected late (``tests/test_resume.py``, about 120 s of
    multi-rank runs) could run alone at the end while the other worker idled; starting the long ones first leaves
    the short in-process modules to even out the end (measured on this machine: the suite's wall 526 -> 482 s). The
    order within a module is kept."""
    long = {item.nodeid.split("::")[0] for item in items
            if item.get_closest_marker("launch") or item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in long)


def pytest_itemcollected(item):
    """The first test collected that starts processes starts the pool's fork server: it imports the kit and the
    recipes while the rest is collected (single-threaded imports beside single-threaded imports, so the first
    tests' OpenMP threads do not compete with it), and every pooled rank is forked from it ready
    (``testkit.runs``)."""
    from mvp_engine.engine.testkit import runs
    from mvp_engine.engine.testkit.launch import NO_LAUNCH_ENV

    if "launch" in item.keywords and os.environ.get(NO_LAUNCH_ENV) != "1":
        runs.start_fork_server()


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its counts to the controller, which prints the session's total."""
    from mvp_engine.engine.testkit.launch import RUN_COUNTS

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["run_counts"] = dict(RUN_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from mvp_engine.engine.testkit.launch import RUN_COUNTS

    RUN_COUNTS.update(getattr(node, "workeroutput", {}).get("run_counts", {}))


def pytest_terminal_summary(terminalreporter):
    from mvp_engine.engine.testkit.launch import RUN_COUNTS

    counts = ", ".join(f"{how} {RUN_COUNTS[how]}" for how in ("launched", "pooled", "forked", "in-process"))
    terminalreporter.write_line(f"trainings: {counts}")
