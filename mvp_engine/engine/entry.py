"""A recipe's entry point: Hydra over ``conf/<recipe>.yaml``, then one run whose config or data error is one line.

Kept apart from the training loop (``trainer``) so that what a user sees when a run cannot start (the stop line,
the exit status, the process-group teardown) is decided in one small module.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMRecordError, TooManyBadRecords

from .config import CONF_DIR, ConfigError
from .demo import with_demo_data
from .launch import end_processes
from .recipe import Recipe
from .trainer import Trainer


def run_recipe(cfg: DictConfig, recipe: Recipe) -> dict:
    """Hydra entry body of every recipe: a bad config or bad data stops the run with one line on stderr naming the
    key or the record, exit status 1; the process group is torn down on every way out."""
    try:
        outcome = _run_or_stop_line(cfg, recipe)
        if isinstance(outcome, dict):
            return outcome
        # printed before the process group goes down (``SystemExit(line)`` would print it only after: a launcher
        # kills the other ranks as soon as one exits, so a slower rank's line would be lost)
        print(outcome, file=sys.stderr, flush=True)
        raise SystemExit(1)
    finally:
        end_processes()


def _run_or_stop_line(cfg: DictConfig, recipe: Recipe) -> dict | str:
    """The run's summary, or the one line a config or data error stops it with. The error is not re-raised: its
    traceback holds the trainer and its DDP model, and a DDP reducer that outlives the process-group teardown is
    destroyed at interpreter exit, where gloo's worker thread can deadlock on the GIL (seen: both ranks of a 2-rank
    ``on_bad_record=error`` run hung in ``~ProcessGroupGloo``). Returning drops the traceback here, so
    ``end_processes`` collects the model before the group goes."""
    try:
        return Trainer(with_demo_data(cfg), recipe).run()
    except ConfigError as err:
        return f"config error: {err}"
    except (MLLMRecordError, TooManyBadRecords) as err:  # while planning, or while decoding (all ranks at one step)
        return f"data error: {err}"


def hydra_main(recipe: Recipe):
    """The ``main()`` of ``recipes/<name>/train.py``: Hydra over ``conf/<name>.yaml``, then :func:`run_recipe`."""

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run_recipe(cfg, recipe)

    return main
