"""Optimizer steps a training config will take, from the run's own planner: no model weights, no image decoded.

Why: schedulers, budgets and checkpoint intervals need the step count before the run starts, and it must be the
number the run really takes. ``Trainer`` sizes its schedule with ``dataset.estimate_total_steps`` of the dataset
``mvp_engine.engine.run_data`` builds; this plans the same dataset (rank 0 of the world size), calls the same
method and shows how each epoch gets there (``mvp_engine.engine.plan_report.compute_step_estimate``): packs ->
packs per rank -> micro-batches per rank -> optimizer steps (a short last accumulation still steps;
``train.drop_last`` drops the uneven tail instead of padding short ranks with all-padding rows).

    python tools/estimate_steps.py +packing=greedy data.max_seq_len=2048 train.gradient_accumulation_steps=4
    python tools/estimate_steps.py +packing=bfd +report.world_size=8 train.drop_last=true
    WORLD_SIZE=8 python tools/estimate_steps.py +packing=greedy     # as under torchrun / accelerate launch

World size: ``report.world_size`` (``ReportSpec`` in ``mvp_engine/engine/report_config.py``), else ``$WORLD_SIZE``,
else 1.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.plan_report import compute_step_estimate


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
        estimate = compute_step_estimate(with_demo_data(cfg))
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    print(format_estimate(estimate))


if __name__ == "__main__":
    main()
