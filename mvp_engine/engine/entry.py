"""A recipe's entry point: Hydra over ``conf/<recipe>.yaml``, then one run whose config or data error is one line.

Kept apart from the training loop (``trainer``) so that what a user sees when a run cannot start (the stop line,
the exit status, the process-group teardown) is decided in one small module.
"""

from __future__ import annotations

import os
import sys
import typing

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from mvp_engine.kit.mllm.data import MLLMRecordError, TooManyBadRecords

from .config import CONF_DIR, ConfigError, train_spec
from .config_errors import hydra_error_line
from .demo import with_demo_data
from .launch import end_processes, report_to_launcher, use_threads
from .recipe import Recipe
from .trainer import Trainer

# Hydra re-raises its errors (instead of printing them over several lines) while this is set
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"


def stop(line: str) -> typing.NoReturn:
    """End the process with ``line``, exit status 1: on stderr, and in the error file a launcher reads (torchrun's
    failure summary, printed after every rank's output, then shows this line instead of a link to its docs)."""
    print(line, file=sys.stderr, flush=True)
    report_to_launcher(line)
    raise SystemExit(1)


def run_recipe(cfg: DictConfig, recipe: Recipe) -> dict:
    """Hydra entry body of every recipe: a bad config or bad data stops the run with one line on stderr naming the
    key or the record, exit status 1; the process group is torn down on every way out."""
    try:
        outcome = _run_or_stop_line(cfg, recipe)
        if isinstance(outcome, dict):
            return outcome
        # printed before the process group goes down (``SystemExit(line)`` would print it only after: a launcher
        # kills the other ranks as soon as one exits, so a slower rank's line would be lost)
        stop(outcome)
    finally:
        end_processes()


def _run_or_stop_line(cfg: DictConfig, recipe: Recipe) -> dict | str:
    """The run's summary, or the one line a config or data error stops it with. The error is not re-raised: its
    traceback holds the trainer and its DDP model, and a DDP reducer that outlives the process-group teardown is
    destroyed at interpreter exit, where gloo's worker thread can deadlock on the GIL (seen: both ranks of a 2-rank
    ``on_bad_record=error`` run hung in ``~ProcessGroupGloo``). Returning drops the traceback here, so
    ``end_processes`` collects the model before the group goes."""
    try:
        use_threads(train_spec(cfg).num_threads)
        return Trainer(with_demo_data(cfg), recipe).run()
    except ConfigError as err:
        return f"config error: {err}"
    except (MLLMRecordError, TooManyBadRecords) as err:  # while planning, or while decoding (all ranks at one step)
        return f"data error: {err}"
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler is in place, or pressed a second time
        return ("stopped by SIGINT at once (before the first step, or Ctrl-C pressed twice): nothing since the last "
                "checkpoint is saved; train.resume_from=auto continues from it, if the run wrote one")


def hydra_main(recipe: Recipe):
    """The ``main()`` of ``recipes/<name>/train.py``: Hydra over ``conf/<name>.yaml``, then :func:`run_recipe`.

    A key or value Hydra refuses while composing (before the run starts) is one line too: Hydra re-raises it here
    (``HYDRA_FULL_ERROR`` is set only until the run starts, so an error of the run itself is reported as before)."""
    started, user_setting = False, None

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def run(cfg: DictConfig) -> None:
        nonlocal started
        started = True
        _set_env(HYDRA_FULL_ERROR, user_setting)
        run_recipe(cfg, recipe)

    def main() -> None:
        nonlocal started, user_setting
        started, user_setting = False, os.environ.get(HYDRA_FULL_ERROR)
        os.environ[HYDRA_FULL_ERROR] = "1"
        try:
            run()
        except (HydraException, OmegaConfBaseException) as err:
            if started:  # the run's own error, as Hydra reports it
                raise
            recipes = sorted(path.stem for path in CONF_DIR.glob("*.yaml"))
            stop(f"config error: {hydra_error_line(err, recipes)}")
        finally:
            _set_env(HYDRA_FULL_ERROR, user_setting)

    return main


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
