"""The stand-alone evaluation entry (``python -m recipes.<name>.evaluate``): every recipe that trains has one; it
runs as Hydra job ``evaluate``, not as the training entry's ``train`` (both read ``conf/<name>.yaml``), and like it
writes no log file (Hydra's job logging goes to the console only: the engine prints its lines). In process: the
entry's Hydra start is what is checked, the evaluation itself is replaced."""

from __future__ import annotations

import importlib
import logging
import re
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig

import mvp_engine.engine.evaluate as entry_module
from mvp_engine.engine.config import CONF_DIR, compose_config
from mvp_engine.engine.recipe import load_recipe

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes"


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


def test_the_evaluate_entry_runs_as_its_own_job_and_writes_no_log_file(monkeypatch, tmp_path, hydra_logging):
    assert start_entry(monkeypatch, tmp_path) == entry_module.JOB_NAME == "evaluate"
    assert not list(tmp_path.glob("*.log"))


def test_a_job_name_on_the_command_line_still_wins(monkeypatch, tmp_path, hydra_logging):
    assert start_entry(monkeypatch, tmp_path, "hydra.job.name=mine") == "mine"


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.iterdir() if (p / "train.py").is_file()))
def test_every_recipe_that_trains_has_an_evaluate_entry(name):
    """Found, not listed: a recipe added with a ``train.py`` and no ``evaluate.py`` fails here."""
    assert (RECIPES / name / "evaluate.py").is_file(), f"recipes/{name} trains but has no evaluate.py"
    entry, train = (importlib.import_module(f"recipes.{name}.{module}") for module in ("evaluate", "train"))
    assert callable(entry.main) and entry.RECIPE is train.RECIPE


def test_the_readme_evaluate_example_names_the_model_folder_a_run_writes():
    """The README's ``model.pretrained=outputs/<dir>/<time>/model``: ``<dir>`` is what the recipe's ``hydra.run.dir``
    (``outputs/${model.name}/<time>``) makes of its model, not the model config's file name."""
    readme = (REPO_ROOT / "README.md").read_text()
    ((name, folder),) = re.findall(r"recipes\.(\w+)\.evaluate model\.pretrained=outputs/([^/\s]+)/<time>/model", readme)
    run_dir = yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())["hydra"]["run"]["dir"]
    assert run_dir.startswith("outputs/${model.name}/"), run_dir
    assert folder == compose_config(name).model.name
