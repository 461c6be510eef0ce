"""Shared test setup: ``gpu`` tests skip cleanly on machines without CUDA and are the only ones that see it: every
other test runs as on a CPU machine (``VLM_PACKING_DEVICE=cpu``, ``mvp_engine/engine/device.py``), so the suite's
CPU claims hold on a GPU machine too. Every test session measures into its own cache folder (so do the processes
tests launch, which inherit the environment): a user's ``~/.cache/vlm_packing`` is never read or written by the
tests. The session ends with how many trainings ran and how (launched interpreters, pooled multi-rank runs,
in-process runs): the suite's cost is counted, not guessed."""

import os
import tempfile

import pytest
import torch

from mvp_engine.engine.device import DEVICE_ENV

os.environ["VLM_PACKING_CACHE"] = tempfile.mkdtemp(prefix="vlm_packing_cache_")


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """A test not marked ``gpu`` runs on the CPU: engine runs (in-process, pooled, launched: they inherit the
    environment) pick the CPU, gloo and CPU-only backends, as on a machine without CUDA."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv(DEVICE_ENV, "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """A session that will start processes starts the pool's fork server now: it imports the kit and the recipes
    while the first tests run, and every pooled rank is forked from it ready (``testkit.runs``)."""
    from mvp_engine.engine.testkit.launch import NO_LAUNCH_ENV

    if os.environ.get(NO_LAUNCH_ENV) != "1" and any("launch" in item.keywords for item in session.items):
        from mvp_engine.engine.testkit.runs import start_fork_server

        start_fork_server()


def pytest_terminal_summary(terminalreporter):
    from mvp_engine.engine.testkit.launch import RUN_COUNTS

    counts = ", ".join(f"{how} {RUN_COUNTS[how]}" for how in ("launched", "pooled", "in-process"))
    terminalreporter.write_line(f"trainings: {counts}")
