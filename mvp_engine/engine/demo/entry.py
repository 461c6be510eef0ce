"""The demo data set as a run's source, filled in by an entry point before anything is built."""

from __future__ import annotations

import copy

from omegaconf import DictConfig

from ..config import demo_spec
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
    cfg.data.sources = [str(write_demo_dataset(demo.out_dir, demo.num_samples, demo.seed, videos=demo.videos))]
    return cfg
