"""The demo data set as a run's source, filled in by an entry point before anything is built."""

from __future__ import annotations

import copy
from pathlib import Path

from omegaconf import DictConfig

from ..config import DemoSpec, demo_spec
from .pairs import write_demo_pairs
from .writer import write_demo_dataset


def with_demo_data(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose empty ``data.sources`` names the demo set (written on first use, ``demo.*``) when
    ``demo.enabled``; ``cfg`` itself otherwise. The recipe entry point and every tool call it first, so building a
    ``Trainer`` or a report writes no file."""
    if cfg.data.get("sources") or cfg.get("demo") is None:
        return cfg
    demo = demo_spec(cfg)
    if not demo.enabled:
        return cfg
    cfg = copy.deepcopy(cfg)
    demo_set = write_demo_dataset(demo_dir(demo), demo.num_samples, demo.seed, videos=demo.videos)
    if cfg.get("train") is not None and cfg.train.get("objective") == "dpo":
        demo_set = write_demo_pairs(demo_set)  # the same conversations as preference pairs
    cfg.data.sources = [str(demo_set)]
    return cfg


def demo_dir(demo: DemoSpec) -> Path:
    """The folder of the demo set these settings make, under ``demo.out_dir``: one per settings, so runs with
    different ``demo.num_samples`` (or seed, or videos) neither share one folder nor rewrite each other's files
    while one of them reads them."""
    return Path(demo.out_dir) / f"{demo.num_samples}_seed{demo.seed}{'_videos' if demo.videos else ''}"
