"""Validate a recipe's packed behaviour: every soft check on the run's own objects, then optionally the hard ones.

Soft checks (in process, on the recipe's tiny model and a small demo set; ``data_checks`` and ``model_checks``):
``packing-knobs``, ``custom-assembler``, ``pack-fields``, ``collator-padding``, ``model-preparation``,
``accounting``. Hard checks (``hard=True``, subprocesses from the repository root): ``compileall`` of the DataKit and
the recipe, then the recipe's ``tests/test_structure.py`` and ``tests/test_smoke.py``.

``validate_recipe`` emits one ``PASS|FAIL name: evidence`` line per check as it completes and returns the
``CheckResult`` list; ``tools/validate_recipe.py`` is its command line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from ..config import CONF_DIR
from .data_checks import (
    check_accounting,
    check_collator_padding,
    check_custom_assembler,
    check_pack_fields,
    check_packing_knobs,
)
from .evidence import CheckResult, first_line
from .model_checks import check_model_preparation
from .recipe_run import RecipeRun, build_recipe_run, recipe_module

REPO_ROOT = CONF_DIR.parent

SOFT_CHECKS: tuple[tuple[str, Callable[[RecipeRun], tuple[bool, str]]], ...] = (
    ("packing-knobs", check_packing_knobs),
    ("custom-assembler", check_custom_assembler),
    ("pack-fields", check_pack_fields),
    ("collator-padding", check_collator_padding),
    ("model-preparation", check_model_preparation),
    ("accounting", check_accounting),
)


def run_check(name: str, check: Callable[[Any], tuple[bool, str]], run: RecipeRun) -> CheckResult:
    """A check that raises fails with the exception's first line: one broken link must not hide the others."""
    try:
        ok, evidence = check(run)
    except Exception as err:  # noqa: BLE001 - any error is this check's failure, reported on its line
        ok, evidence = False, f"{type(err).__name__}: {first_line(err)}"
    return CheckResult(name, ok, evidence)


def hard_commands(name: str) -> list[tuple[str, list[str]]]:
    """The seed's hard checks for ``recipes/<name>``, as subprocess argument lists run from the repository root."""
    python = sys.executable
    return [
        ("compileall", [python, "-m", "compileall", "-q", "mvp_engine/kit/mllm/data", f"recipes/{name}"]),
        ("structure-tests", [python, "-m", "pytest", f"recipes/{name}/tests/test_structure.py", "-q"]),
        ("smoke-tests", [python, "-m", "pytest", f"recipes/{name}/tests/test_smoke.py", "-q"]),
    ]


def run_hard(name: str, command: list[str]) -> CheckResult:
    """A subprocess check: its exit code and last output line are the evidence."""
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no output"
    shown = " ".join(["python", *command[1:]])
    return CheckResult(name, result.returncode == 0, f"`{shown}` exit {result.returncode} in {seconds:.1f} s: {last}")


def validate_recipe(name: str, cfg: DictConfig, module: str | None = None, hard: bool = False,
                    emit: Callable[[str], None] = print) -> list[CheckResult]:
    """Every check of recipe ``name`` (``RECIPE`` of ``module``, default ``recipes.<name>.train``) on ``cfg``
    (``validation_config``, its sources filled), each line emitted as it completes; raises ``ConfigError`` when it
    cannot start."""
    run = build_recipe_run(name, cfg, module)
    emit(f"validate_recipe: {run.recipe.name} (conf/{name}.yaml, {recipe_module(name, module)}), packing "
         f"{run.packing.strategy}, max_seq_len {run.packing.max_seq_len}, {len(run.dataset.records)} demo records")
    results = []
    for check_name, check in SOFT_CHECKS:
        results.append(run_check(check_name, check, run))
        emit(results[-1].line())
    for check_name, command in hard_commands(name) if hard else []:
        results.append(run_hard(check_name, command))
        emit(results[-1].line())
    return results
