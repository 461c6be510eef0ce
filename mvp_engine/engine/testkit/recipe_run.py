"""The run a recipe validation looks at: the config its training command would compose, and that run's ``Trainer``.

Why the ``Trainer``: it builds the dataset (the engine's ``build_run_dataset``), collator, encoder and step estimate
exactly as training does, so the checks look at what training uses, not at a re-implementation. Building it
writes no file: the config's ``data.sources`` are filled by the entry point (``mvp_engine.engine.demo``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMPackingSpec

from ..config import ConfigError
from ..recipe import Recipe
from ..trainer import Trainer
from .structure import compose_config

# a 32-record demo set, 2 epochs of micro-batches of 2: every soft check runs in seconds on the tiny model
DEFAULT_OVERRIDES = ("demo.num_samples=32", "data.max_seq_len=512", "train.micro_batch_size=2", "train.epochs=2")
DEFAULT_PACKING = "+packing=greedy"


@dataclass
class RecipeRun:
    """The recipe under validation, its composed config and the run's ``Trainer``."""

    name: str
    recipe: Recipe
    cfg: DictConfig
    trainer: Trainer

    @property
    def dataset(self):
        return self.trainer.dataset

    @property
    def packing(self) -> MLLMPackingSpec:
        return self.trainer.specs.data.packing

    @property
    def pad_token_id(self) -> int:
        return self.recipe.pad_token_id(self.trainer.processor)


def recipe_module(name: str, module: str | None = None) -> str:
    return module or f"recipes.{name}.train"


def recipe_from_module(module: str) -> Recipe:
    """``RECIPE`` of ``module`` (a recipe's ``train`` module, a test fixture, a recipe under development)."""
    recipe = getattr(importlib.import_module(module), "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"{module} has no RECIPE (a mvp_engine.engine.recipe.Recipe)")
    return recipe


def validation_overrides(user: Sequence[str], workdir: Path) -> list[str]:
    """The defaults, then the user's overrides (last wins); greedy packing unless the user chose one."""
    chooses_packing = any(o.lstrip("+~").split("=")[0] == "packing" for o in user)
    return [*DEFAULT_OVERRIDES, f"demo.out_dir={workdir / 'demo'}", f"train.output_dir={workdir / 'run'}",
            *([] if chooses_packing else [DEFAULT_PACKING]), *user]


def validation_config(name: str, overrides: Sequence[str], workdir: Path) -> DictConfig:
    """The config ``python -m recipes.<name>.train <overrides>`` would compose, demo and run folders under
    ``workdir``; packing is required, since every soft check is about packs."""
    cfg = compose_config(name, validation_overrides(overrides, workdir))
    if cfg.get("packing") is None:
        raise ConfigError("packing: this tool validates packed behaviour; give +packing=greedy or +packing=bfd")
    return cfg


def build_recipe_run(name: str, cfg: DictConfig, module: str | None = None) -> RecipeRun:
    recipe = recipe_from_module(recipe_module(name, module))
    return RecipeRun(name, recipe, cfg, Trainer(cfg, recipe))
