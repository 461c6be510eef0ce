"""How well a training config packs, planned from metadata alone: no model is built and no image is decoded.

Why: packing quality, padding and the step count decide what a run costs, and they can be known before the run.
This takes exactly a training command's overrides (same primary config; ``--config-name`` picks another recipe),
builds that recipe's processor and encoder, builds the dataset with ``MLLMDataKit.build_dataset`` and plans one
epoch with the same planner the run uses (``dataset.plan(epoch)``: text lengths and image header sizes only).

    python tools/pack_report.py +packing=greedy data.max_seq_len=2048 demo.num_samples=300
    python tools/pack_report.py +packing=bfd +report.out_dir=/tmp/pack_report +report.world_size=8
    python tools/pack_report.py                       # no +packing: the unpacked baseline, one sample per row

Printed (and written to ``report.json`` next to ``pack_report.png``, three histograms): packs against the lower
bound ceil(sum of admitted lengths / max_seq_len), fill, samples and media per pack, drops by reason, padding
ratio and attention work (sum of segment^2 against rows x width^2) at the configured micro-batch, where the
collated width is the longest pack of each micro-batch rounded up to ``train.pad_to_multiple_of`` (what
``MLLMCollator`` pads to, not ``max_seq_len``), and the optimizer steps the run will take
(``dataset.estimate_total_steps``). Micro-batches are cut from each rank's packs in order, as a ``DataLoader``
with ``train.num_workers=0`` cuts them.

Compute, from the cost model (``mvp_engine.engine.flops``: the recipe's model built on the meta device, no weights):
useful forward + backward FLOPs per pack and per rank, and the per-step imbalance (largest per-rank cost / mean
per-rank cost: mean and 95th percentile over the epoch's full steps, the partial tail step apart) with
``packing.balance`` none and compute, at ``report.balance_ranks`` simulated ranks (default: the world size, 8 when
that is 1) and the run's micro-batch size x gradient accumulation packs per rank per step:

    python tools/pack_report.py +packing=bfd packing.balance=compute

Settings of this tool live under ``report.*`` (``conf/report/default.yaml``, ``ReportSpec`` below); they are
not in the recipe's defaults, so set them with ``+report.KEY=VALUE``. ``compute_pack_report(cfg)`` returns the
numbers as a dict for tests and other tools; printing and plotting only format that dict.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as ``python tools/pack_report.py`` without an installed package
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from mvp_engine.engine.config import (  # noqa: E402
    ConfigError,
    RunSpecs,
    data_with_sources,
    resolve_run_specs,
)
from mvp_engine.engine.flops import planning_cost_profile  # noqa: E402
from mvp_engine.engine.plan_report import batch_accounting, micro_batches, rank_rows  # noqa: E402,F401 (validate_recipe)
from mvp_engine.engine.recipe import Recipe  # noqa: E402
from mvp_engine.engine.testing import load_recipe  # noqa: E402
from mvp_engine.kit.mllm.data import (  # noqa: E402
    CostProfile,
    MLLMDataKit,
    balanced_order,
    imbalance_summary,
)
from mvp_engine.kit.mllm.data.balance import balance_rng  # noqa: E402

REPORT_DEFAULTS = REPO_ROOT / "conf" / "report" / "default.yaml"
JSON_NAME = "report.json"
PNG_NAME = "pack_report.png"
UNIT_BINS_UP_TO = 60  # integer histograms get one bar per value up to this many distinct values


@dataclass
class ReportSpec:
    """The ``report.*`` keys (defaults in ``conf/report/default.yaml``); shared with ``tools/estimate_steps.py``."""

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


@dataclass
class Planning:
    """What the numbers are computed from: the validated run specs and the run's own dataset (rank 0)."""

    recipe: Recipe
    specs: RunSpecs
    dataset: Any  # MLLMPackedDataset | MLLMStreamingPackedDataset
    world_size: int
    cost_profile: CostProfile


# --- configuration -------------------------------------------------------------------------------------------


def report_spec(cfg: DictConfig) -> ReportSpec:
    """``conf/report/default.yaml`` overlaid with whatever ``report.*`` the command line added."""
    node = cfg.get("report")
    given = {} if node is None else OmegaConf.to_container(node, resolve=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ReportSpec), OmegaConf.load(REPORT_DEFAULTS), given)
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


def recipe_name(cfg: DictConfig, spec: ReportSpec) -> str:
    """``report.recipe``, else the primary config's name (``--config-name``), which names the recipe."""
    if spec.recipe:
        return spec.recipe
    if HydraConfig.initialized() and HydraConfig.get().job.config_name:
        return str(HydraConfig.get().job.config_name)
    return str(cfg.model.name)


def build_planning_dataset(cfg: DictConfig, recipe: str, world_size: int = 1) -> Planning:
    """The run's dataset exactly as ``Trainer`` builds it (rank 0 of ``world_size``), minus the model."""
    loaded = load_recipe(recipe)
    specs = resolve_run_specs(cfg, loaded.attention_backends)
    encoder = loaded.build_encoder(loaded.build_processor(cfg.model))
    data = data_with_sources(specs)
    profile = planning_cost_profile(loaded, cfg.model)
    train = specs.train
    dataset = MLLMDataKit.build_dataset(data, encoder, rank=0, world_size=world_size, drop_last=train.drop_last,
                                        micro_batch_size=train.micro_batch_size,
                                        gradient_accumulation_steps=train.gradient_accumulation_steps,
                                        cost_profile=profile)
    return Planning(recipe=loaded, specs=specs, dataset=dataset, world_size=world_size, cost_profile=profile)


# --- numbers -------------------------------------------------------------------------------------------------


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
        "batching": batch_accounting(dataset, epoch, train),
        "steps": {"epochs": train.epochs, "micro_batch_size": train.micro_batch_size,
                  "gradient_accumulation_steps": train.gradient_accumulation_steps,
                  "world_size": dataset.world_size, "drop_last": train.drop_last},
        "histograms": {"fill": histogram(fills, bins, (0.0, 1.0)), "samples_per_pack": histogram(samples, bins),
                       "media_per_pack": histogram(media, bins)},
        "cost": compute_costs(dataset, epoch, balance_ranks or (dataset.world_size if dataset.world_size > 1 else 8)),
    }
    # last: planning every epoch replaces the dataset's cached plan of ``epoch``
    report["estimated_optimizer_steps"] = dataset.estimate_total_steps(
        train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    return report


def compute_pack_report(cfg: DictConfig, spec: ReportSpec | None = None) -> dict:
    """The report of a composed config (as a training command would compose it)."""
    spec = spec or report_spec(cfg)
    planning = build_planning_dataset(cfg, recipe_name(cfg, spec), resolve_world_size(spec))
    return describe_plan(planning, spec.epoch, spec.bins, spec.balance_ranks)


# --- output --------------------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _imbalance(summary: dict) -> str:
    if summary["mean"] is None:
        return f"no full step ({summary['tail_steps']} partial)"
    tail = ", ".join(f"{x:.2f}" for x in summary["tail"]) or "none"
    return (f"mean {summary['mean']:.3f}, p95 {summary['p95']:.3f}, max {summary['max']:.3f} over "
            f"{summary['full_steps']} full steps (tail step apart: {tail})")


def format_costs(c: dict) -> list[str]:
    per_pack, per_rank, balance = c["per_pack"], c["per_rank"], c["balance"]
    ranks = per_rank["values"]
    none, compute = balance["none"], balance["compute"]
    return [
        f"cost per pack (useful fwd+bwd GFLOP): mean {_num(per_pack['mean'] / 1e9, 3)}, min "
        f"{_num(per_pack['min'] / 1e9, 3)}, max {_num(per_pack['max'] / 1e9, 3)}; epoch {per_pack['total'] / 1e12:.4g} "
        "TFLOP",
        f"cost per rank (world size {per_rank['world_size']}, GFLOP): "
        + ", ".join(f"{v / 1e9:.4g}" for v in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
        + f"; max/mean {_num(per_rank['max_over_mean'], 3)}",
        f"per-step imbalance (max/mean per-rank cost) at {none['world_size']} simulated ranks x "
        f"{none['packs_per_rank_per_step']} pack(s) per rank per step (packing.balance={balance['configured']}, "
        f"window {balance['window_steps']} steps):",
        f"  balance none:    {_imbalance(none)}",
        f"  balance compute: {_imbalance(compute)}",
    ]


def format_report(r: dict) -> str:
    """The report as the lines the tool prints."""
    b, s = r["batching"], r["steps"]
    packing = "none (unpacked baseline: one sample per row)" if r["packing"] is None else r["packing"]
    fill, per_pack, media = r["fill"], r["samples_per_pack"], r["media_per_pack"]
    drops = ", ".join(f"{k} {v}" for k, v in r["dropped"].items()) or "none"
    return "\n".join([
        f"pack report: recipe {r['recipe']}, packing {packing}, max_seq_len {r['max_seq_len']}, epoch {r['epoch']} "
        f"({r['assembler']}, {r['dataset_class']})",
        f"records {r['records']}: admitted {r['admitted_samples']} (truncated {r['truncated_samples']}), "
        f"dropped {r['dropped_total']} ({drops}); bad {r['bad_total']} "
        f"({', '.join(f'{k} {v}' for k, v in r['bad_records'].items()) or 'none'}; image bodies not decoded: "
        "tools/check_data.py --decode)",
        f"packs {r['packs']} vs lower bound {r['lower_bound_packs']} = ceil({r['admitted_tokens']} admitted tokens / "
        f"{r['max_seq_len']}): {_num(r['packs_over_lower_bound'], 3)}x, efficiency {_pct(r['packing_efficiency'])}",
        f"fill per pack: mean {_pct(r['mean_fill'])}, min {_pct(fill['min'])}, max {_pct(fill['max'])}",
        f"samples per pack: mean {_num(per_pack['mean'])}, min {per_pack['min']}, max {per_pack['max']}",
        f"media per pack: mean {_num(media['mean'])}, min {media['min']}, max {media['max']}, total {media['total']}",
        f"micro-batches of {b['micro_batch_size']} rows: {b['micro_batches']} in all, {b['micro_batches_per_rank']} "
        f"per rank x {b['world_size']} rank(s), {b['all_padding_rows']} all-padding rows, drop_last {b['drop_last']}",
        f"  collated width = {b['width_rule']}",
        f"  padding ratio {_pct(b['padding_ratio'])} ({b['effective_tokens']} effective of {b['slots']} slots)",
        f"  attention work sum(segment^2) {b['attention_work']} vs dense rows x width^2 {b['dense_attention_work']}: "
        f"{_pct(b['attention_work_ratio'])}",
        *format_costs(r["cost"]),
        f"estimated optimizer steps: {r['estimated_optimizer_steps']} ({s['epochs']} epochs, micro batch "
        f"{s['micro_batch_size']}, gradient accumulation {s['gradient_accumulation_steps']}, world size "
        f"{s['world_size']}, drop_last {s['drop_last']})",
    ])


def plot_report(r: dict, path: Path) -> None:
    """Three histograms (pack fill, samples per pack, media per pack) from the report's own bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = (("fill", "pack fill (tokens / max_seq_len)", r["mean_fill"], "{:.1%}"),
              ("samples_per_pack", "samples per pack", r["samples_per_pack"]["mean"], "{:.2f}"),
              ("media_per_pack", "media items per pack", r["media_per_pack"]["mean"], "{:.2f}"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label, mean, fmt) in zip(axes, panels):
        hist = r["histograms"][key]
        ax.stairs(hist["counts"], hist["edges"], fill=True, alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("packs")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"mean {'n/a' if mean is None else fmt.format(mean)}")
    packing = r["packing"] or "unpacked"
    fig.suptitle(f"{r['recipe']} / {packing} / max_seq_len {r['max_seq_len']}: {r['packs']} packs "
                 f"(lower bound {r['lower_bound_packs']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(r: dict, out_dir: Path) -> tuple[Path, Path]:
    """``report.json`` (the dict as is) and ``pack_report.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / JSON_NAME, out_dir / PNG_NAME
    json_path.write_text(json.dumps(r, indent=2) + "\n")
    plot_report(r, png_path)
    return json_path, png_path


def resolve_out_dir(spec: ReportSpec) -> Path:
    """``report.out_dir``, else ``pack_report/`` inside the Hydra run directory."""
    if spec.out_dir:
        return Path(spec.out_dir)
    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        return Path(HydraConfig.get().runtime.output_dir) / "pack_report"
    return Path("outputs") / "pack_report"


@hydra.main(config_path="../conf", config_name="qwen2_vl", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        spec = report_spec(cfg)
        report = compute_pack_report(cfg, spec)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    json_path, png_path = write_report(report, resolve_out_dir(spec))
    print(format_report(report))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
