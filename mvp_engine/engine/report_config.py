"""What a report or a step estimate plans: the ``report.*`` settings, the world size and the recipe to plan for.

Settings of the tools live under ``report.*`` (``ReportSpec``, the one home of their defaults); they are not in the
recipes' defaults, so a command line sets them with ``+report.KEY=VALUE`` and the rest keep ``ReportSpec``'s values
(``+report=default`` composes them all: ``conf/report/default.yaml`` extends ``report/report_schema``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError
from .recipe import load_recipe, recipe_name
from .run_data import Planning, planning_dataset


@dataclass
class ReportSpec:
    """The ``report.*`` keys and their defaults."""

    out_dir: str | None = None
    epoch: int = 0
    world_size: int | None = None
    recipe: str | None = None
    bins: int = 20
    balance_ranks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"report.epoch={self.epoch!r} is invalid: allowed an int >= 0")
        if self.world_size is not None and (not isinstance(self.world_size, int) or self.world_size < 1):
            raise ConfigError(f"report.world_size={self.world_size!r} is invalid: allowed null or an int >= 1")
        if not isinstance(self.bins, int) or self.bins < 1:
            raise ConfigError(f"report.bins={self.bins!r} is invalid: allowed an int >= 1")
        if self.balance_ranks is not None and (not isinstance(self.balance_ranks, int) or self.balance_ranks < 1):
            raise ConfigError(f"report.balance_ranks={self.balance_ranks!r} is invalid: allowed null or an int >= 1")


# the schema conf/report/default.yaml extends (+report=default)
ConfigStore.instance().store(group="report", name="report_schema", node=ReportSpec)


def report_spec(cfg: DictConfig) -> ReportSpec:
    """``ReportSpec``'s defaults overlaid with whatever ``report.*`` the command line added."""
    node = cfg.get("report")
    given = {} if node is None else OmegaConf.to_container(node, resolve=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ReportSpec), given)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf type and unknown-key errors
        raise ConfigError(f"report: {str(err).splitlines()[0]}") from None


def resolve_world_size(spec: ReportSpec) -> int:
    """``report.world_size``, else ``$WORLD_SIZE`` (set by torchrun / accelerate launch), else 1."""
    if spec.world_size is not None:
        return spec.world_size
    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"WORLD_SIZE={raw!r} is invalid: allowed an int >= 1 (or set +report.world_size)")
    return int(raw)


def planned_run(cfg: DictConfig, spec: ReportSpec) -> Planning:
    """The dataset of the run ``cfg`` describes, for ``spec``'s recipe and world size (rank 0)."""
    return planning_dataset(cfg, load_recipe(recipe_name(cfg, spec.recipe)), resolve_world_size(spec))
