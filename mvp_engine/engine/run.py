"""One run assembly: everything a run is made of, built one way for the trainer (``purpose="train"``), the
stand-alone evaluation (``"eval"``) and the reports, step estimates and benches (``"plan"``).

Why one function: a report, a step estimate or an evaluation is only true of a run if it is built from the same
validated specs, layout, model (adapters and frozen parameters included: the cost model reads them) and dataset
(the same rank split, step shape and cost profile); assembling a run anywhere else drifts.

A training run's parts, in order: the specs (``model.*`` included, validated once), the accelerator and the seed,
the layout with its one device mesh, the checkpoint it resumes from (checked before anything is built), processor
and encoder, the model (``run_model.prepare_model``: build, adapters, freezing), what the step reads of it (dummy
media, media kinds, the cost profile), the dataset, collator, step, step estimate and evaluator, and last
``parallel.parallelize`` (recompute, CP attention, the recipe's plan, FSDP2 / DDP), so that everything before it
reads the model unwrapped. Building a run writes no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import (
    CostProfile,
    MLLMCollator,
    MLLMDataKit,
    MLLMDataSpec,
    MLLMRecord,
    MLLMSampleEncoder,
)
from mvp_engine.kit.mllm.data.media import IMAGES, MediaKind

from .checkpoint import load_run_state, resolve_resume
from .checkpoint_folder import check_checkpoint_fits, check_checkpoint_folder
from .config import ConfigError, RunSpecs, TrainSpec, resolve_run_specs
from .evaluation import Evaluator, build_evaluator
from .flops import recipe_cost_profile
from .launch import build_accelerator, use_deterministic
from .model_folder import check_model_folder
from .parallel import ParallelLayout, build_layout, parallelize, plan_layout
from .participation import ParameterReport, media_kinds
from .preference import build_objective, eval_pairs, pair_dataset, preference_spec, settle_layout
from .recipe import Recipe
from .router_balance import build_router_balance
from .row_widths import run_collator
from .run_guards import claim_run_dir, refuse_without_steps
from .run_identity import check_identity, run_identity, setting_defaults
from .run_model import PURPOSES, prepare_model
from .train_step import TrainStep


@dataclass
class Run:
    """A run's parts (what ``purpose`` needs of them; the rest stay None): ``model`` is the one the run computes
    with, parallelized (a plan's lives on the meta device); ``dataset`` is the training set (``evaluator`` holds the
    eval sets); ``total_steps`` the optimizer steps the run will take."""

    recipe: Recipe
    cfg: DictConfig
    specs: RunSpecs
    purpose: str
    layout: ParallelLayout
    processor: Any
    encoder: MLLMSampleEncoder
    model: torch.nn.Module
    parameters: ParameterReport | None = None
    accelerator: Accelerator | None = None
    output_dir: Path | None = None
    resume_from: Path | None = None  # the checkpoint a training run starts from (None: a fresh start)
    identity: dict | None = None  # what a training run is (run_identity), recorded in its checkpoints
    dummy_media: dict = field(default_factory=dict)
    media_kinds: tuple[MediaKind, ...] = (IMAGES,)
    cost_profile: CostProfile | None = None
    dataset: Any = None  # MLLMPackedDataset | MLLMStreamingPackedDataset
    collator: MLLMCollator | None = None
    step: TrainStep | None = None
    total_steps: int = 0
    evaluator: Evaluator | None = None

    @property
    def world_size(self) -> int:
        """Processes of the run (a plan's: the processes it plans for)."""
        return self.layout.world_size

    @property
    def packed(self) -> bool:
        return self.specs.data.packing is not None

    @property
    def step_shape(self) -> tuple[int, int, int]:
        """How each step's packs are split over ranks and micro-batches: a resume must keep their product."""
        return step_shape(self.specs.train, self.layout)


Planning = Run  # what the reports and estimates read: a run assembled with purpose="plan"


def step_shape(train: TrainSpec, layout: ParallelLayout) -> tuple[int, int, int]:
    return layout.dp_size, train.micro_batch_size, train.gradient_accumulation_steps


def assemble(cfg: DictConfig, recipe: Recipe, purpose: str = "train", world_size: int = 1) -> Run:
    """The run ``cfg`` describes, for ``purpose``: ``train`` (every part), ``eval`` (the model as saved, the eval
    sets, collator, step and evaluator; ``data.eval_sources`` must name some) or ``plan`` (rank 0 of ``world_size``
    processes, without any: specs, processor, encoder, the model on the meta device, its cost profile and the
    training set, from metadata alone). A bad config stops with one ``ConfigError`` line naming the key."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r} is invalid: allowed one of {list(PURPOSES)}")
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    if specs.model.pretrained:  # before anything reads it: transformers fails late, and with advice about other things
        check_model_folder(specs.model.pretrained, recipe.model_types)
    if purpose == "plan":
        return _plan(cfg, recipe, specs, world_size)
    return _assemble(cfg, recipe, specs, purpose)


def planning_dataset(cfg: DictConfig, recipe: Recipe, world_size: int = 1) -> Planning:
    """The run's dataset as ``Trainer`` builds it, rank 0 of ``world_size`` (over its data-parallel ranks, i.e.
    ``world_size / train.context_parallel_size``), with the cost model read from the model built on the meta
    device: what reports and estimates plan, from metadata alone."""
    return assemble(cfg, recipe, "plan", world_size)


def _plan(cfg: DictConfig, recipe: Recipe, specs: RunSpecs, world_size: int) -> Run:
    if specs.data.streaming:
        raise ConfigError("data.streaming=true: a stream is read in order, not indexed, so nothing plans it ahead (no "
                          "step estimate, pack report or plan): the run takes train.max_steps optimizer steps; plan "
                          "the same sources without data.streaming to see their packs")
    layout = plan_layout(world_size, specs.train.context_parallel_size, specs.data.packing is not None)
    processor = recipe.build_processor(cfg.model)
    encoder = recipe.build_encoder(processor)
    model, parameters = prepare_model(recipe, cfg.model, specs.model, "eager", "plan")
    profile = recipe_cost_profile(recipe, model)
    # a CP group shares its rows: the data (and the steps) are split over the data-parallel ranks only
    preference = preference_spec(cfg, specs)  # train.objective=dpo: the sources hold pairs, planned as items
    if preference is None:
        dataset = build_run_dataset(specs, encoder, profile, 0, layout.dp_size)
    else:
        dataset = pair_dataset(specs, preference, encoder, lambda pair_encoder, pairs: build_run_dataset(
            specs, pair_encoder, profile, 0, layout.dp_size, records=pairs), model)
    return Run(recipe, cfg, specs, "plan", layout, processor, encoder, model, parameters, cost_profile=profile,
               dataset=dataset)


def _assemble(cfg: DictConfig, recipe: Recipe, specs: RunSpecs, purpose: str) -> Run:
    training, train = purpose == "train", specs.train
    preference = preference_spec(cfg, specs, training)  # train.objective=dpo
    accelerator, output_dir = _start(specs, training)
    layout = build_layout(accelerator, train.context_parallel_size, specs.data.packing is not None,
                          train.dist_timeout_s)
    identity = run_identity(recipe.name, specs) if training else None
    resume_from = _resume_point(train, output_dir, layout, identity, setting_defaults(specs)) if training else None
    if training:
        claim_run_dir(output_dir, train.resume_from, resume_from)
    processor = recipe.build_processor(cfg.model)
    encoder = recipe.build_encoder(processor)
    # FSDP2 from a pretrained folder: rank 0 alone reads the weights, the other ranks build on the meta device and
    # receive their shards in parallelize
    weights_from_rank0 = training and train.sharding == "fsdp2" and bool(specs.model.pretrained)
    model, parameters = prepare_model(recipe, cfg.model, specs.model, specs.attention, purpose,
                                      without_weights=weights_from_rank0 and not accelerator.is_main_process)
    if resume_from is not None:  # before the data set is built for a model the checkpoint cannot fill
        check_checkpoint_fits(resume_from, model, specs.model.lora.enabled)
    if not training:
        model = model.to(accelerator.device)
        if preference is not None:  # held-out pairs of a saved policy: laid out as its training run laid them
            settle_layout(preference, model, specs.attention, accelerator.print)
    # MoE routers hooked before parallelize wraps the model (the hooks stay on the modules FSDP2 / DDP keep)
    routers = recipe.moe_routers(model) if training and recipe.moe_routers is not None else None
    balance = build_router_balance(routers, train.router_aux_loss_coef if training else None,
                                   train.router_aux_loss_scope, lambda t: accelerator.reduce(t, reduction="sum"),
                                   train.router_bias_update_rate if training else 0.0,
                                   per_layer=train.router_aux_loss_layers == "per_layer")
    run = Run(recipe, cfg, specs, purpose, layout, processor, encoder, model, parameters, accelerator, output_dir,
              resume_from, identity, recipe.dummy_media(model), media_kinds(model, encoder))
    if training:
        # FLOPs per unit of work of this model as it trains: the per-step FLOPs and MFU, and packing.balance=compute
        run.cost_profile = recipe_cost_profile(recipe, model)
        if preference is None:
            run.dataset = build_run_dataset(specs, encoder, run.cost_profile, layout.dp_rank, layout.dp_size)
        else:  # train.objective=dpo: the sources hold preference pairs, one packing item each
            run.dataset = pair_dataset(specs, preference, encoder, lambda pair_encoder, pairs: build_run_dataset(
                specs, pair_encoder, run.cost_profile, layout.dp_rank, layout.dp_size, records=pairs), model,
                accelerator.print)
    # packed metadata (positions, M-RoPE included, cu_seqlens, spans) computed where the batches are collated, on the
    # CPU in the loader's workers, so the step reads no device value back to build its kwargs
    run.collator = run_collator(recipe.pad_token_id(processor), specs, layout.cp_size,
                                recipe.packed_metadata(model) if run.packed else None)
    run.step = TrainStep(accelerator, recipe.prepare_packed if run.packed else recipe.prepare_padded, specs.attention,
                         run.dummy_media, train, run.media_kinds, layout.shard, balance,
                         build_objective(preference, model, accelerator.device, train.sharding == "fsdp2")
                         if preference is not None else None)
    if training:
        # a stream (data.streaming) is read in order, not planned: its length is train.max_steps by construction
        run.total_steps = train.max_steps if specs.data.streaming else run.dataset.estimate_total_steps(train.epochs)
        refuse_without_steps(run.dataset, run.total_steps)
    run.evaluator = build_evaluator(specs, accelerator, encoder, run.collator, run.step, layout,
                                    eval_pairs(preference, encoder) if preference is not None else None)
    reference = run.step.objective.reference if run.step.objective is not None else None  # dpo.reference=copy
    run.model = parallelize(model, layout, train, recipe, accelerator if training else None, weights_from_rank0,
                            reference)
    return run


def _start(specs: RunSpecs, training: bool) -> tuple[Accelerator, Path]:
    """The accelerator and the run directory, once the data is known to be there (one line saying what to do
    before any model is built); a training run's seed is set here, before anything draws from it, and
    ``train.deterministic`` before anything computes."""
    train = specs.train
    use_deterministic(train.deterministic)
    if not training:
        if not specs.data.eval_sources:
            raise ConfigError("data.eval_sources is empty: name the records to evaluate on (data.eval_sources=[...])")
        return (build_accelerator(train.mixed_precision, timeout_s=train.dist_timeout_s),
                Path(train.output_dir or "outputs/eval"))
    run_data_spec(specs)
    output_dir = Path(train.output_dir or "outputs/run")
    accelerator = build_accelerator(train.mixed_precision, train.sharding, train.report_to, output_dir,
                                    train.dist_timeout_s)
    set_seed(train.seed)
    return accelerator, output_dir


def _resume_point(train: TrainSpec, output_dir: Path, layout: ParallelLayout, identity: dict,
                  defaults: dict) -> Path | None:
    """The checkpoint the run resumes from (``train.resume_from``), its split and its run's ``identity`` checked
    (settings newer than the checkpoint compared with their ``defaults``) before anything is built."""
    resume_from = resolve_resume(train.resume_from, output_dir)
    if resume_from is not None:
        check_checkpoint_folder(resume_from)
        state = load_run_state(resume_from)
        state.check_resume(*step_shape(train, layout), train.drop_last, source=resume_from)
        warning = check_identity(state.identity, identity, resume_from, defaults)
        if warning and layout.rank == 0:
            print(warning)
    return resume_from


# --- the run's dataset ----------------------------------------------------------------------------------------


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
    or ``records`` already read from them), in the run's step shape; its bad-record report is
    ``dataset.bad_records``. The benches call it alone, on specs of their own."""
    train = specs.train
    return MLLMDataKit.build_dataset(run_data_spec(specs), encoder, rank=rank, world_size=world_size,
                                     drop_last=train.drop_last, records=records,
                                     micro_batch_size=train.micro_batch_size,
                                     gradient_accumulation_steps=train.gradient_accumulation_steps,
                                     cost_profile=cost_profile, max_steps=train.max_steps)
