"""How well a training config packs, planned from metadata alone: no model weights, no image decoded.

Why: packing quality, padding and the step count decide what a run costs, and they can be known before the run.
This takes exactly a training command's overrides (same primary config; ``--config-name`` picks another recipe),
plans one epoch of the run's own dataset and prints the numbers ``mvp_engine.engine.plan_report`` computes (its
docstring says how: the trainer's dataset, collated widths, step arithmetic and cost model).

    python tools/pack_report.py +packing=greedy data.max_seq_len=2048 demo.num_samples=300
    python tools/pack_report.py +packing=bfd +report.out_dir=/tmp/pack_report +report.world_size=8
    python tools/pack_report.py +packing=bfd packing.balance=compute
    python tools/pack_report.py                       # no +packing: the unpacked baseline, one sample per row

Printed (and written to ``report.json`` next to ``pack_report.png``, three histograms): packs against the lower
bound ceil(sum of admitted lengths / max_seq_len), fill, samples and media per pack, drops by reason, padding
ratio and attention work (sum of segment^2 against rows x width^2) at the configured micro-batch, cost per pack and
per rank with the per-step imbalance under ``packing.balance`` none and compute, and the optimizer steps the run
will take. Settings: ``+report.KEY=VALUE`` (``ReportSpec``, ``mvp_engine/engine/report_config.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.plan_report import compute_pack_report
from mvp_engine.engine.report_config import ReportSpec, report_spec

JSON_NAME = "report.json"
PNG_NAME = "pack_report.png"


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
        report = compute_pack_report(with_demo_data(cfg), spec)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    json_path, png_path = write_report(report, resolve_out_dir(spec))
    print(format_report(report))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
