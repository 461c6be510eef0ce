"""Optimizer steps a training config will take, from the run's own planner: no model, no image decoded.

Why: schedulers, budgets and checkpoint intervals need the step count before the run starts, and it must be the
number the run really takes. ``Trainer`` sizes its schedule with ``dataset.estimate_total_steps``; this builds
the same dataset (``MLLMDataKit.build_dataset`` with the recipe's encoder, rank 0 of the world size) and calls
the same method, then shows how each epoch gets there: packs -> packs per rank -> micro-batches per rank ->
optimizer steps (a short last accumulation still steps; ``train.drop_last`` drops the uneven tail instead of
padding short ranks with all-padding rows).

    python tools/estimate_steps.py +packing=greedy data.max_seq_len=2048 train.gradient_accumulation_steps=4
    python tools/estimate_steps.py +packing=bfd +report.world_size=8 train.drop_last=true
    WORLD_SIZE=8 python tools/estimate_steps.py +packing=greedy     # as under torchrun / accelerate launch

World size: ``report.world_size`` (``conf/report/default.yaml``), else ``$WORLD_SIZE``, else 1.
``compute_step_estimate(cfg)`` returns the numbers as a dict.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as ``python tools/estimate_steps.py`` without an installed package
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mvp_engine.engine.config import ConfigError, TrainSpec  # noqa: E402
from mvp_engine.kit.mllm.data import micro_batches_per_rank, optimizer_steps, packs_per_rank  # noqa: E402
from tools.pack_report import (  # noqa: E402
    ReportSpec,
    build_planning_dataset,
    recipe_name,
    report_spec,
    resolve_world_size,
)


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
        "world_size": dataset.world_size,
        "drop_last": train.drop_last,
        "per_epoch": epochs,
        "total_optimizer_steps": total,
    }


def compute_step_estimate(cfg: DictConfig, spec: ReportSpec | None = None) -> dict:
    """The estimate for a composed config (as a training command would compose it)."""
    spec = spec or report_spec(cfg)
    planning = build_planning_dataset(cfg, recipe_name(cfg, spec), resolve_world_size(spec))
    packing = planning.specs.data.packing
    estimate = estimate_from_dataset(planning.dataset, planning.specs.train,
                                     None if packing is None else packing.strategy)
    return {"recipe": planning.recipe.name, **estimate}


def format_estimate(e: dict) -> str:
    packing = "none (unpacked: one sample per row)" if e["packing"] is None else e["packing"]
    lines = [f"recipe {e['recipe']}, packing {packing}, max_seq_len {e['max_seq_len']}: {e['epochs']} epochs, "
             f"micro batch {e['micro_batch_size']}, gradient accumulation {e['gradient_accumulation_steps']}, "
             f"world size {e['world_size']}, drop_last {e['drop_last']}"]
    for k, epoch in enumerate(e["per_epoch"]):
        lines.append(f"epoch {k}: {epoch['packs']} packs -> {epoch['packs_per_rank']} per rank -> "
                     f"{epoch['micro_batches_per_rank']} micro-batches per rank -> {epoch['optimizer_steps']} "
                     "optimizer steps")
    lines.append(f"total optimizer steps: {e['total_optimizer_steps']}")
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="qwen2_vl", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        estimate = compute_step_estimate(cfg)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    print(format_estimate(estimate))


if __name__ == "__main__":
    main()
