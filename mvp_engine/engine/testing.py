"""Reusable checks for recipe tests: compose configs, validate every combination, run short smoke trainings.

A recipe's ``tests/test_structure.py`` and ``tests/test_smoke.py`` call these in a few lines, so every recipe
is held to the same contract.
"""

from __future__ import annotations

import importlib
import inspect
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMSampleEncoder

from .config import ATTENTION_BACKENDS, check_attention, resolve_run_specs
from .recipe import Recipe
from .trainer import Trainer

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
PACKINGS = (None, "greedy", "bfd")


def compose_config(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a ``python -m recipes.<name>.train <overrides>`` run would see (no Hydra run dir)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def packing_overrides(packing: str | None) -> list[str]:
    return [] if packing is None else [f"+packing={packing}"]


def load_recipe(name: str) -> Recipe:
    return importlib.import_module(f"recipes.{name}.train").RECIPE


def check_structure(name: str) -> None:
    """Entry point, hooks and the encoder protocol are in place."""
    module = importlib.import_module(f"recipes.{name}.train")
    assert callable(getattr(module, "main", None)), f"recipes.{name}.train has no main()"
    recipe = module.RECIPE
    assert recipe.name == name
    for hook in ("prepare_packed", "prepare_padded"):
        params = list(inspect.signature(getattr(recipe, hook)).parameters)
        assert params[:3] == ["batch", "model", "attn_implementation"], f"{hook} signature is {params}"
    cfg = compose_config(name)
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    assert isinstance(encoder, MLLMSampleEncoder), "the encoder lacks encode/measure"


def runnable_backends(recipe: Recipe) -> list[str]:
    """The recipe's attention backends this machine can run."""
    usable = []
    for backend in recipe.attention_backends:
        try:
            check_attention(backend, recipe.attention_backends)
        except ValueError:
            continue
        usable.append(backend)
    return usable


def check_all_combinations_compose(name: str) -> int:
    """Every packing x attention combination composes; runnable ones validate, the rest fail naming the key."""
    recipe = load_recipe(name)
    checked = 0
    for packing in PACKINGS:
        for backend in ATTENTION_BACKENDS:
            cfg = compose_config(name, [*packing_overrides(packing), f"attention={backend}"])
            assert cfg.attention.implementation == backend
            assert (cfg.get("packing") is None) == (packing is None)
            if backend in runnable_backends(recipe):
                specs = resolve_run_specs(cfg, recipe.attention_backends)
                assert (specs.data.packing is None) == (packing is None)
                if packing is not None:
                    assert specs.data.packing.strategy == packing
                    assert specs.data.packing.max_seq_len == specs.data.max_seq_len
            else:
                try:
                    resolve_run_specs(cfg, recipe.attention_backends)
                except ValueError as err:
                    assert "attention.implementation" in str(err)
                else:
                    raise AssertionError(f"attention={backend} validated on a machine that cannot run it")
            checked += 1
    return checked


def smoke_run(name: str, packing: str | None, output_dir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """A short real training run on the demo data; returns the summary plus the planned totals to check."""
    cfg = compose_config(name, [
        *packing_overrides(packing), "demo.num_samples=48", "data.max_seq_len=512", "train.epochs=2",
        "train.micro_batch_size=2", "train.learning_rate=5e-3", "train.warmup_ratio=0.0",
        f"train.output_dir={output_dir}", f"demo.out_dir={output_dir.parent / 'demo'}", *overrides,
    ])
    trainer = Trainer(cfg, load_recipe(name))
    summary = trainer.run()
    plans = [trainer.dataset.plan(epoch) for epoch in range(trainer.specs.train.epochs)]
    summary["planned"] = {
        "samples": sum(len(p) for plan in plans for p in plan.packs),
        "packs": sum(len(plan.packs) for plan in plans),
        "effective": sum(plan.lengths[i] for plan in plans for p in plan.packs for i in p),
        "dropped": dict(sum((plan.drop_counts for plan in plans), Counter())),
    }
    return summary


def check_smoke_summary(summary: dict) -> None:
    """Finite, falling loss; the run trained exactly what was planned; the step estimate held."""
    losses = summary["losses"]
    assert losses and all(x == x and abs(x) != float("inf") for x in losses), f"non-finite loss in {losses}"
    assert summary["loss_last"] < summary["loss_first"], f"loss did not fall: {losses}"
    assert summary["actual_steps"] == summary["estimated_steps"]
    totals, planned = summary["totals"], summary["planned"]
    assert totals["samples"] == planned["samples"]
    assert totals["packs"] == planned["packs"]
    assert totals["effective"] == planned["effective"]
    assert totals["dropped"] == planned["dropped"]
    assert 0 <= totals["padding_ratio"] < 1
