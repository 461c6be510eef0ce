"""The numbers of a planned epoch: how it packs, pads and costs, and the optimizer steps it takes.

Why in the engine: ``tools/pack_report.py``, ``tools/estimate_steps.py`` and ``tools/validate_recipe.py`` report
these numbers, and they must be the run's: the dataset ``run_data`` builds for the trainer, planned by
``dataset.plan(epoch)`` (text lengths and image header sizes only: no model weights, no image decoded), cut into
micro-batches as a ``DataLoader`` with ``train.num_workers=0`` cuts each rank's packs, collated to the longest
pack of each micro-batch raised to the run's row widths (``row_widths.run_collator``: flex_attention's power-of-two
widths) and rounded up to ``train.pad_to_multiple_of`` (what ``MLLMCollator`` pads to, not ``max_seq_len``), and
counted with the kit's own step arithmetic. The tools only print and plot these dicts.

Compute comes from the cost model (``mvp_engine.engine.flops``: the recipe's model built on the meta device):
useful forward + backward FLOPs per pack and per rank, and the per-step imbalance (largest per-rank cost / mean
per-rank cost: mean and 95th percentile over the epoch's full steps, the partial tail step apart) with
``packing.balance`` none and compute, at ``report.balance_ranks`` simulated ranks (default: the world size, 8 when
that is 1) and the run's micro-batch size x gradient accumulation packs per rank per step.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import (
    MLLMCollator,
    balanced_order,
    imbalance_summary,
    micro_batches_per_rank,
    optimizer_steps,
    packs_per_rank,
)
from mvp_engine.kit.mllm.data.balance import balance_rng

from .config import TrainSpec
from .report_config import ReportSpec, planned_run, report_spec
from .row_widths import run_collator
from .run import Planning

WIDTH_RULE = ("longest pack of each micro-batch, raised to the run's row widths (flex_attention: powers of two) and "
              "rounded up to train.pad_to_multiple_of (as MLLMCollator pads)")
UNIT_BINS_UP_TO = 60  # integer histograms get one bar per value up to this many distinct values


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def histogram(values: list[float], bins: int, value_range: tuple[float, float] | None = None) -> dict:
    """Counts and bin edges; integer data with a narrow range gets one bar per value."""
    if value_range is None and values and max(values) - min(values) < UNIT_BINS_UP_TO:
        edges = np.arange(min(values) - 0.5, max(values) + 1.5)
        counts, edges = np.histogram(values, bins=edges)
    else:
        counts, edges = np.histogram(values, bins=bins, range=value_range if values else (0, 1))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def rank_rows(dataset, rank: int, epoch: int) -> list[list[int]]:
    """``rank``'s packs through the dataset's own ``rank_packs`` (a shallow copy shares the cached metadata)."""
    view = dataset if rank == dataset.rank else copy.copy(dataset)
    view.rank = rank
    return list(view.rank_packs(epoch))


def micro_batches(rows: list[list[int]], micro_batch_size: int, drop_last: bool) -> list[list[list[int]]]:
    """Consecutive groups of ``micro_batch_size`` rows; a short last group survives unless ``drop_last``."""
    groups = [rows[k:k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
    if drop_last and groups and len(groups[-1]) < micro_batch_size:
        groups.pop()
    return groups


def batch_accounting(dataset, epoch: int, train: TrainSpec, collator: MLLMCollator | None = None) -> dict:
    """Padding and attention work of every micro-batch on every rank, as ``TokenAccounting.from_batch`` counts, at
    the widths ``collator`` pads to (None: ``train.pad_to_multiple_of`` alone)."""
    lengths = dataset.plan(epoch).lengths.tolist()
    collator = collator or MLLMCollator(pad_token_id=0, pad_to_multiple_of=train.pad_to_multiple_of)
    totals = dict.fromkeys(("micro_batches", "rows", "all_padding_rows", "slots", "effective_tokens",
                            "attention_work", "dense_attention_work"), 0)
    for rank in range(dataset.world_size):
        for group in micro_batches(rank_rows(dataset, rank, epoch), train.micro_batch_size, train.drop_last):
            segments = [[lengths[i] for i in pack] for pack in group]
            width = collator.padded_length(max(sum(row) for row in segments))
            totals["micro_batches"] += 1
            totals["rows"] += len(group)
            totals["all_padding_rows"] += sum(1 for pack in group if not pack)
            totals["slots"] += len(group) * width
            totals["effective_tokens"] += sum(sum(row) for row in segments)
            totals["attention_work"] += sum(n * n for row in segments for n in row)
            totals["dense_attention_work"] += len(group) * width * width
    num_packs = len(dataset.plan(epoch).packs)
    return {
        "width_rule": WIDTH_RULE,
        "world_size": dataset.world_size,
        "micro_batch_size": train.micro_batch_size,
        "drop_last": train.drop_last,
        "pad_to_multiple_of": train.pad_to_multiple_of,
        "micro_batches_per_rank": micro_batches_per_rank(num_packs, train.micro_batch_size, dataset.world_size,
                                                         train.drop_last),
        **totals,
        "padding_ratio": 1.0 - totals["effective_tokens"] / totals["slots"] if totals["slots"] else 0.0,
        "attention_work_ratio": _ratio(totals["attention_work"], totals["dense_attention_work"]),
    }


def compute_costs(dataset, epoch: int, balance_ranks: int) -> dict:
    """Useful FLOPs per pack and per rank of the plan as it will run, and the per-step imbalance at
    ``balance_ranks`` simulated ranks with ``packing.balance`` none (the planner's order, round-robin) and compute."""
    packs = list(dataset.plan(epoch).packs)
    costs = dataset.pack_costs(packs)
    per_rank = [float(costs[rank::dataset.world_size].sum()) for rank in range(dataset.world_size)]
    planned = list(dataset._groups(epoch))  # the planner's own order: what balance none serves
    layout = dataset.step_layout(len(planned), balance_ranks)
    balanced = list(balanced_order(planned, layout, dataset.pack_costs, dataset.packing_spec.balance_window,
                                   balance_rng(dataset.packing_spec.seed, epoch)))
    return {
        "unit": "useful forward + backward FLOPs (cost model of the recipe's model, mvp_engine.engine.flops)",
        "per_pack": {**_stats(costs.tolist()), "total": float(costs.sum())},
        "per_rank": {"world_size": dataset.world_size, "values": per_rank,
                     "max_over_mean": max(per_rank) / (sum(per_rank) / len(per_rank)) if sum(per_rank) else None},
        "balance": {
            "configured": dataset.packing_spec.balance,
            "window_steps": dataset.packing_spec.balance_window,
            "none": imbalance_summary(dataset.pack_costs(planned), layout),
            "compute": imbalance_summary(dataset.pack_costs(balanced), layout),
        },
    }


def describe_plan(planning: Planning, epoch: int = 0, bins: int = 20, balance_ranks: int | None = None) -> dict:
    """Every reported number for one epoch of ``planning.dataset``; metadata only."""
    dataset, train = planning.dataset, planning.specs.train
    plan = dataset.plan(epoch)
    cap = dataset.packing_spec.max_seq_len
    lengths, num_media = plan.lengths.tolist(), dataset.metas.num_media.tolist()
    pack_tokens = [sum(lengths[i] for i in pack) for pack in plan.packs]
    samples = [len(pack) for pack in plan.packs]
    media = [sum(num_media[i] for i in pack) for pack in plan.packs]
    fills = [n / cap for n in pack_tokens]
    admitted_tokens = sum(pack_tokens)
    lower_bound = math.ceil(admitted_tokens / cap)
    packing = planning.specs.data.packing
    report = {
        "recipe": planning.recipe.name,
        "packing": None if packing is None else packing.strategy,
        "assembler": type(dataset.assembler).__name__,
        "dataset_class": type(dataset).__name__,
        "max_seq_len": cap,
        "epoch": epoch,
        "records": len(dataset.records),
        "admitted_samples": sum(samples),
        "truncated_samples": len(plan.truncated),
        "dropped": dict(sorted(plan.drop_counts.items())),
        "dropped_total": len(plan.dropped),
        # records left out as bad before planning (read and header faults; bodies are not decoded here)
        "bad_records": dict(planning.dataset.bad_records.counts().most_common()),
        "bad_total": planning.dataset.bad_records.count,
        "packs": len(plan.packs),
        "admitted_tokens": admitted_tokens,
        "lower_bound_packs": lower_bound,
        "packs_over_lower_bound": _ratio(len(plan.packs), lower_bound),
        "packing_efficiency": _ratio(lower_bound, len(plan.packs)),
        "mean_fill": _ratio(admitted_tokens, len(plan.packs) * cap),
        "fill": _stats(fills),
        "samples_per_pack": _stats(samples),
        "media_per_pack": {**_stats(media), "total": sum(media)},
        "batching": batch_accounting(dataset, epoch, train, run_collator(0, planning.specs)),
        "steps": {"epochs": train.epochs, "micro_batch_size": train.micro_batch_size,
                  "gradient_accumulation_steps": train.gradient_accumulation_steps,
                  "world_size": dataset.world_size, "context_parallel_size": train.context_parallel_size,
                  "drop_last": train.drop_last},
        "histograms": {"fill": histogram(fills, bins, (0.0, 1.0)), "samples_per_pack": histogram(samples, bins),
                       "media_per_pack": histogram(media, bins)},
        "cost": compute_costs(dataset, epoch, balance_ranks or (dataset.world_size if dataset.world_size > 1 else 8)),
    }
    # last: planning every epoch replaces the dataset's cached plan of ``epoch``
    report["estimated_optimizer_steps"] = dataset.estimate_total_steps(
        train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    return report


def epoch_breakdown(num_packs: int, train: TrainSpec, world_size: int) -> dict:
    """One epoch's way from packs to optimizer steps, with the kit's own step arithmetic."""
    micro = micro_batches_per_rank(num_packs, train.micro_batch_size, world_size, train.drop_last)
    return {
        "packs": num_packs,
        "packs_per_rank": packs_per_rank(num_packs, world_size, train.drop_last),
        "micro_batches_per_rank": micro,
        "optimizer_steps": optimizer_steps(micro, train.gradient_accumulation_steps),
    }


def estimate_from_dataset(dataset, train: TrainSpec, packing: str | None = None) -> dict:
    """The per-epoch breakdown and the total ``Trainer`` uses; refuses to print two numbers that disagree."""
    epochs = [epoch_breakdown(len(dataset.plan(epoch).packs), train, dataset.world_size)
              for epoch in range(train.epochs)]
    total = dataset.estimate_total_steps(train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    if total != sum(e["optimizer_steps"] for e in epochs):
        raise RuntimeError(f"dataset.estimate_total_steps gave {total} but the epochs add up to "
                           f"{sum(e['optimizer_steps'] for e in epochs)}")
    return {
        "packing": packing,
        "max_seq_len": dataset.packing_spec.max_seq_len,
        "epochs": train.epochs,
        "micro_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "world_size": dataset.world_size,  # data-parallel ranks: a CP group shares one set of rows
        "context_parallel_size": train.context_parallel_size,
        "drop_last": train.drop_last,
        "per_epoch": epochs,
        "total_optimizer_steps": total,
    }


def compute_pack_report(cfg: DictConfig, spec: ReportSpec | None = None) -> dict:
    """The report of a composed config whose sources are filled (as a training command would compose it)."""
    spec = spec or report_spec(cfg)
    return describe_plan(planned_run(cfg, spec), spec.epoch, spec.bins, spec.balance_ranks)


def compute_step_estimate(cfg: DictConfig, spec: ReportSpec | None = None) -> dict:
    """The step estimate of a composed config whose sources are filled."""
    planning = planned_run(cfg, spec or report_spec(cfg))
    packing = planning.specs.data.packing
    estimate = estimate_from_dataset(planning.dataset, planning.specs.train,
                                     None if packing is None else packing.strategy)
    return {"recipe": planning.recipe.name, **estimate}
