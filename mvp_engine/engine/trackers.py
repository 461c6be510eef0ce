"""Experiment trackers (``train.report_to``: tensorboard, wandb, mlflow) through accelerate's tracker API.

They get exactly the numbers ``metrics.jsonl`` gets (train and eval lines), plus the run config, and keep their
files inside the run directory: TensorBoard event files under ``<run dir>/tensorboard``, an offline W&B run under
``<run dir>/wandb`` (``WANDB_MODE`` decides; unset, the run is offline, since no run here may need the network), an
MLflow file store under ``<run dir>/mlruns`` unless ``MLFLOW_TRACKING_URI`` names a server.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict
from pathlib import Path

from accelerate import Accelerator
from omegaconf import OmegaConf

# tracker name -> the package it needs (its pip name is the same)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
PROJECT = "vlm-packing"


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_report_to(names: list[str]) -> None:
    """Known tracker names whose package is installed, or one line naming the key and the ``pip install``."""
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ValueError(f"train.report_to: {name!r} is unknown: allowed any of {list(TRACKER_PACKAGES)}")
        package = TRACKER_PACKAGES[name]
        if not installed(package):
            raise ValueError(f"train.report_to: {name!r} needs the {package} package: pip install {package}")
    if len(set(names)) != len(names):
        raise ValueError(f"train.report_to={names!r} names a tracker twice")


def tracker_init_kwargs(run_dir: Path) -> dict:
    """Where each tracker writes: inside the run directory."""
    return {"wandb": {"dir": str(run_dir), "mode": os.environ.get("WANDB_MODE", "offline")},
            "mlflow": {"logging_dir": os.environ.get("MLFLOW_TRACKING_URI", str(run_dir / "mlruns"))}}


def flat_config(config: dict, prefix: str = "") -> dict:
    """The run config as flat ``a.b`` keys with scalar values (TensorBoard's hparams take no nesting or lists)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


def run_config(recipe: str, specs, cfg) -> dict:
    """What a tracker records as the run's config: the validated data and train specs, the attention backend and
    the model section as composed."""
    return {"recipe": recipe, "attention": specs.attention, "data": asdict(specs.data), "train": asdict(specs.train),
            "model": OmegaConf.to_container(cfg.model, resolve=True)}


def scalars(record: dict) -> dict:
    """The numbers of a ``metrics.jsonl`` line a tracker can plot (per-rank lists and ``step`` itself aside)."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class RunTrackers:
    """The run's trackers on the main process (accelerate logs on the main process only); nothing without any."""

    def __init__(self, accelerator: Accelerator, names: list[str], run_dir: Path, run_name: str, config: dict):
        self.accelerator = accelerator
        self.active = bool(names)
        if self.active:
            accelerator.init_trackers(run_name, config=flat_config(config), init_kwargs=tracker_init_kwargs(run_dir))

    def log(self, record: dict) -> None:
        """One ``metrics.jsonl`` line, at its step."""
        if self.active:
            self.accelerator.log(scalars(record), step=record["step"])

    def end(self) -> None:
        """Close every tracker (not ``accelerator.end_training``: it also destroys the process group, which the
        end-of-run gathers still use)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
