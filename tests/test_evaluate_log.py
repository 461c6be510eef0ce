"""The stand-alone evaluation entry (``python -m recipes.<name>.evaluate``) logs to ``evaluate.log``, not to the
training entry's ``train.log`` (both read ``conf/<name>.yaml``, which names the Hydra job ``train``). In process:
the entry's Hydra start is what is checked, the evaluation itself is replaced."""

from __future__ import annotations

import logging
import sys

import pytest
from hydra.core.hydra_config import HydraConfig

import mvp_engine.engine.evaluate as entry_module
from mvp_engine.engine.recipe import load_recipe


@pytest.fixture
def hydra_logging():
    """Hydra's job logging adds handlers to the root logger (its file among them): taken off again after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:], root.level = handlers, level


def start_entry(monkeypatch, run_dir, *overrides: str) -> str:
    """Start ``recipes.llava.evaluate`` with ``overrides``; the job name Hydra ran it under."""
    seen = []
    monkeypatch.setattr(entry_module, "evaluate_recipe", lambda cfg, recipe: seen.append(HydraConfig.get().job.name))
    monkeypatch.setattr(sys, "argv", ["evaluate.py", f"hydra.run.dir={run_dir}", *overrides])
    entry_module.hydra_evaluate(load_recipe("llava"))()
    return seen[0]


def test_the_evaluate_entry_logs_to_evaluate_log(monkeypatch, tmp_path, hydra_logging):
    assert start_entry(monkeypatch, tmp_path) == entry_module.JOB_NAME == "evaluate"
    assert (tmp_path / "evaluate.log").is_file() and not (tmp_path / "train.log").exists()


def test_a_job_name_on_the_command_line_still_wins(monkeypatch, tmp_path, hydra_logging):
    assert start_entry(monkeypatch, tmp_path, "hydra.job.name=mine") == "mine"
    assert (tmp_path / "mine.log").is_file()
