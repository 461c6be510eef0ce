"""A run's dataset, built one way for the trainer, the reports, the estimates and the benches.

Why one function: a report or a step estimate is only true if it plans the dataset the run trains on, with the
same data spec, rank split, micro-batch shape and cost model; building it anywhere else drifts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import CostProfile, MLLMDataKit, MLLMDataSpec, MLLMRecord, MLLMSampleEncoder

from .config import ConfigError, RunSpecs, resolve_run_specs
from .flops import planning_cost_profile
from .recipe import Recipe


def run_data_spec(specs: RunSpecs) -> MLLMDataSpec:
    """``specs.data``, or one line saying what to do when it names no source."""
    if not specs.data.sources:
        raise ConfigError("data.sources is empty: name the records to train on (data.sources=[...]), or pass the "
                          "config through mvp_engine.engine.demo.with_demo_data(cfg) for the demo set, as the "
                          "recipe entry point and the tools do")
    return specs.data


def build_run_dataset(specs: RunSpecs, encoder: MLLMSampleEncoder, cost_profile: CostProfile | None,
                      rank: int = 0, world_size: int = 1, records: list[MLLMRecord] | None = None):
    """The dataset ``rank`` of ``world_size`` trains on (``MLLMDataKit.build_dataset``: the sources' record store,
    or ``records`` already read from them); its bad-record report is ``dataset.bad_records``."""
    train = specs.train
    return MLLMDataKit.build_dataset(run_data_spec(specs), encoder, rank=rank, world_size=world_size,
                                     drop_last=train.drop_last, records=records,
                                     micro_batch_size=train.micro_batch_size,
                                     gradient_accumulation_steps=train.gradient_accumulation_steps,
                                     cost_profile=cost_profile)


@dataclass
class Planning:
    """A run's validated specs and its dataset (rank 0), built without the model's weights."""

    recipe: Recipe
    specs: RunSpecs
    dataset: Any  # MLLMPackedDataset | MLLMStreamingPackedDataset
    world_size: int
    cost_profile: CostProfile


def planning_dataset(cfg: DictConfig, recipe: Recipe, world_size: int = 1) -> Planning:
    """The run's dataset as ``Trainer`` builds it, rank 0 of ``world_size`` (over its data-parallel ranks, i.e.
    ``world_size / train.context_parallel_size``), with the cost model read from the
    model built on the meta device: what reports and estimates plan, from metadata alone."""
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    context = specs.train.context_parallel_size
    if world_size % context:
        raise ConfigError(f"train.context_parallel_size={context} does not divide the {world_size} processes "
                          "(world = data-parallel x context-parallel)")
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    profile = planning_cost_profile(recipe, cfg.model)
    # a CP group shares its rows: the data (and the steps) are split over the data-parallel ranks only
    dataset = build_run_dataset(specs, encoder, profile, 0, world_size // context)
    return Planning(recipe=recipe, specs=specs, dataset=dataset, world_size=world_size, cost_profile=profile)
