"""Packs balanced by compute across ranks: how even the steps are, simulated and measured.

Three parts, each its own command:

``simulate`` (the default): synthetic metadata of two mixes, planned with the kit's bfd planner and balanced with the
kit's ``balanced_order`` exactly as the dataset does, costed with a real-size model's cost profile (built on the meta
device from a transformers config: no weights), at 8 simulated ranks. Prints the per-step imbalance (largest per-rank
cost / mean per-rank cost) as the mean and the 95th percentile over the epoch's full steps, the tail step apart,
with ``packing.balance`` none and compute, and OK/MISS against the targets (compute: mean <= 1.05, p95 <= 1.15).

* ``llava``: a LLaVA-1.5-665k-like mix on a LLaVA-1.5-7B profile (Llama-2-7B, CLIP ViT-L/14-336: 576 tokens per
  image), ``max_seq_len`` 4096: single-image conversations, some multi-image, ~8% long text-only.
* ``video``: a video-heavy mix on a Qwen2-VL-7B profile, ``max_seq_len`` 16384: 45% clips (4-32 temporal patches of
  64-300 tokens each), 30% images (64-1280 tokens), 25% text.

``measure``: real processes. Two torchrun ranks on the CPU (gloo) train the tiny Qwen2-VL, with a widened vision tower,
on a mix with very uneven vision load (text-only records next to records with large images), one pack per rank per
step, ``train.time_barrier=true``, with ``packing.balance`` none and compute; prints each rank's compute time per step
and its wait at the barrier before the optimizer step, and both loss curves.

``loss``: the demo run (Qwen2-VL, bfd) with balance none and compute side by side: the loss curves (first and last
values, the mean of the last quarter) and ``loss_curves.png``.

    python tools/bench_balance.py                       # simulate
    python tools/bench_balance.py measure --out /tmp/balance_measure
    python tools/bench_balance.py loss --out /tmp/balance_loss
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.testing import launch, write_image
from mvp_engine.kit.mllm.data import (
    CostProfile,
    MLLMPackingAssembler,
    MLLMPackingSpec,
    StepLayout,
    balance_rng,
    balanced_order,
    imbalance_summary,
    pack_costs,
)

TARGET_MEAN, TARGET_P95 = 1.05, 1.15
RANKS = 8
RECIPE = "qwen2_vl"


# --- simulate ------------------------------------------------------------------------------------------------------


@dataclass
class Mix:
    name: str
    max_seq_len: int
    length: np.ndarray
    num_media: np.ndarray
    media_tokens: np.ndarray
    media_sq: np.ndarray
    profile: CostProfile


def _meta_profile(recipe: str, model_cls, config) -> CostProfile:
    """The recipe's cost profile (its reading of the vision side) of a model of ``config``, built on meta."""
    with torch.device("meta"):
        model = model_cls._from_config(config)
    return load_recipe(recipe).cost_profile(model, [])


def llava_profile() -> CostProfile:
    """LLaVA-1.5-7B: Llama-2-7B, CLIP ViT-L/14 at 336 px (576 tokens per image), two-layer projector."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config={"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                       "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14},
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_id=32000)
    return _meta_profile("llava", LlavaForConditionalGeneration, config)


def qwen2_vl_profile() -> CostProfile:
    """Qwen2-VL-7B: a 28-layer 3584-wide language model, a 32-block 1280-wide vision tower, 2x2 merge."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 3584,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2})
    return _meta_profile("qwen2_vl", Qwen2VLForConditionalGeneration, config)


def llava_mix(n: int, rng: np.random.Generator) -> Mix:
    kind = rng.choice(3, size=n, p=[0.84, 0.08, 0.08])  # single image, multi-image (2-4), text only
    images = np.where(kind == 0, 1, np.where(kind == 1, rng.integers(2, 5, size=n), 0))
    text = np.where(kind == 2, rng.lognormal(6.8, 0.7, size=n), rng.lognormal(5.0, 1.0, size=n)).astype(np.int64)
    text = np.clip(text, 20, 3500)
    tokens = 576 * images
    return Mix("llava", 4096, text + tokens, images, tokens, images * 576 * 576, llava_profile())


def video_mix(n: int, rng: np.random.Generator) -> Mix:
    kind = rng.choice(3, size=n, p=[0.45, 0.30, 0.25])  # video, image, text only
    groups = rng.integers(4, 33, size=n)  # temporal patches of a clip
    per_group = rng.integers(64, 301, size=n)  # merged tokens per temporal patch
    image_tokens = rng.integers(64, 1281, size=n)
    tokens = np.where(kind == 0, groups * per_group, np.where(kind == 1, image_tokens, 0))
    media_sq = np.where(kind == 0, groups * per_group * per_group, np.where(kind == 1, image_tokens ** 2, 0))
    text = np.clip(rng.lognormal(5.5, 1.0, size=n), 20, 6000).astype(np.int64)
    return Mix("video", 16384, text + tokens, (kind < 2).astype(np.int64), tokens, media_sq, qwen2_vl_profile())


def plan_packs(mix: Mix, seed: int = 0) -> list[list[int]]:
    """The kit's bfd planner over the whole mix (as ``+packing=bfd`` plans an epoch)."""
    spec = MLLMPackingSpec(max_seq_len=mix.max_seq_len, strategy="bfd", buffer_size=len(mix.length), seed=seed)
    assembler = MLLMPackingAssembler.from_spec(spec)
    admission = assembler.admit(mix.length, mix.num_media)
    mix.length = admission.lengths
    order = np.random.default_rng([seed, 0]).permutation(len(mix.length))
    order = order[admission.admitted_mask[order]]
    return list(assembler.iter_groups(order, admission.lengths, mix.num_media, assembler.rng(0)))


def costs_of(mix: Mix):
    def costs(packs: list[list[int]]) -> np.ndarray:
        offsets = np.zeros(len(packs) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(p) for p in packs])
        members = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=int(offsets[-1]))
        return pack_costs(mix.profile, offsets, members, mix.length, mix.media_tokens, mix.media_sq, mix.num_media)
    return costs


def simulate(mix: Mix, per_rank: int, window: int, seed: int = 0) -> dict:
    packs = plan_packs(mix, seed)
    costs = costs_of(mix)
    layout = StepLayout(RANKS, per_rank, len(packs))
    balanced = list(balanced_order(packs, layout, costs, window, balance_rng(seed, 0)))
    assert sorted(map(tuple, balanced)) == sorted(map(tuple, packs)), "balancing lost or duplicated a pack"
    return {"packs": len(packs), "none": imbalance_summary(costs(packs), layout),
            "compute": imbalance_summary(costs(balanced), layout)}


def verdict(summary: dict, balance: str) -> str:
    """OK / MISS against the targets for balance compute; "-" for none (the baseline has no target)."""
    if balance == "none":
        return "-"
    ok = summary["mean"] <= TARGET_MEAN and summary["p95"] <= TARGET_P95
    return "OK" if ok else "MISS"


def simulate_rows(args) -> list[dict]:
    """One row per mix, packs per rank per step and balance: the imbalance summary and its verdict."""
    rng = np.random.default_rng(args.seed)
    mixes = {"llava": lambda: llava_mix(args.samples, rng), "video": lambda: video_mix(args.samples // 2, rng)}
    rows = []
    for name in args.mixes:
        mix = mixes[name]()
        for per_rank in args.per_rank:
            result = simulate(mix, per_rank, args.window, args.seed)
            rows += [{"mix": name, "packs": result["packs"], "per_rank": per_rank, "balance": balance,
                      **result[balance], "verdict": verdict(result[balance], balance)}
                     for balance in ("none", "compute")]
    return rows


def run_simulate(args) -> int:
    rows = simulate_rows(args)
    print(f"per-step imbalance (max / mean per-rank useful FLOPs) at {RANKS} simulated ranks, bfd plans, window "
          f"{args.window} steps; targets with balance compute: mean <= {TARGET_MEAN}, p95 <= {TARGET_P95}")
    print("| mix | packs | packs/rank/step | balance | mean | p95 | max | tail step | idle share | target |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tail = ", ".join(f"{x:.2f}" for x in r["tail"]) or "-"
        print(f"| {r['mix']} | {r['packs']} | {r['per_rank']} | {r['balance']} | {r['mean']:.3f} | {r['p95']:.3f} | "
              f"{r['max']:.3f} | {tail} | {r['idle_fraction']:.1%} | {r['verdict']} |")
    return 1 if any(r["verdict"] == "MISS" for r in rows) else 0


# --- measure: two real ranks -----------------------------------------------------------------------------------------

VISION_OVERRIDES = ["model.config.vision_config.embed_dim=128", "model.config.vision_config.depth=4",
                    "model.config.vision_config.num_heads=4", f"model.image_max_pixels={28 * 28 * 256}"]


def write_uneven_mix(out: Path, records: int) -> Path:
    """Text-only records next to records with one or two 448 px images (256 merged tokens, 1,024 patches each)."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(records):
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=int(rng.integers(40, 400))))
        if i % 2:
            convo = [{"from": "human", "value": f"Tell me about {i}."}, {"from": "gpt", "value": words}]
            lines.append({"id": f"text{i}", "conversations": convo})
        else:
            count = 1 + int(rng.integers(0, 2))
            paths = [write_image(images / f"{i}_{k}.png", 448, 448, seed=i * 10 + k) for k in range(count)]
            convo = [{"from": "human", "value": "<image>\n" * count + f"What is {i}?"},
                     {"from": "gpt", "value": words[:200]}]
            lines.append({"id": f"image{i}", "images": paths, "conversations": convo})
    path = out / "uneven.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def train(run_dir: Path, overrides: list[str], nproc: int) -> None:
    """A Qwen2-VL training run to its end (the testkit's launch: one thread per process), stopping on failure."""
    done = launch(RECIPE, run_dir, overrides, nproc=nproc, timeout=None, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(done.args)} failed:\n{done.stderr[-4000:]}")


def read_metrics(run_dir: Path) -> list[dict]:
    """Every column of ``metrics.jsonl``, the wall-clock ones included (what this bench measures)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(losses: list[float]) -> str:
    quarter = losses[-max(1, len(losses) // 4):]
    return (f"first {', '.join(f'{x:.3f}' for x in losses[:3])}; last {', '.join(f'{x:.3f}' for x in losses[-3:])}; "
            f"mean of the last quarter {sum(quarter) / len(quarter):.3f} ({len(losses)} steps)")


def measure_balance(args) -> dict:
    """Two real ranks per balance setting: each rank's compute and barrier wait per step, and the loss curve."""
    out = Path(args.out)
    data = write_uneven_mix(out / "data", args.records)
    common = ["+packing=bfd", f"data.sources=[{data}]", "data.max_seq_len=1024", f"train.epochs={args.epochs}",
              "train.micro_batch_size=1", "train.gradient_accumulation_steps=1", "train.time_barrier=true",
              "train.log_every=1000", "attention=sdpa_varlen", *VISION_OVERRIDES]
    results = {}
    for balance in ("none", "compute"):
        run_dir = out / f"balance_{balance}"
        started = time.perf_counter()
        train(run_dir, [*common, f"packing.balance={balance}"], nproc=2)
        metrics = read_metrics(run_dir)
        compute = np.array([m["compute_ms"] for m in metrics])
        wait = np.array([m["barrier_wait_ms"] for m in metrics])
        results[balance] = {"steps": len(metrics), "wall_s": time.perf_counter() - started,
                            "compute_ms": compute.mean(axis=0).tolist(), "wait_ms": wait.mean(axis=0).tolist(),
                            "slowest_ms": float(compute.max(axis=1).mean()),
                            "step_ms": float((compute + wait).max(axis=1).mean()),
                            "losses": [m["loss"] for m in metrics]}
    return results


def run_measure(args) -> int:
    results = measure_balance(args)
    print(f"2 ranks (torchrun, gloo, CPU, 1 thread each), tiny Qwen2-VL with a 128-wide 4-block vision tower, "
          f"{args.records} records (text-only / one or two 448 px images), bfd at 1024, one pack per rank per step, "
          f"train.time_barrier=true")
    print("| balance | steps | rank 0 compute ms/step | rank 1 compute ms/step | rank 0 wait ms/step | "
          "rank 1 wait ms/step | slowest rank ms/step | step (compute + wait) ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for balance, r in results.items():
        print(f"| {balance} | {r['steps']} | {r['compute_ms'][0]:.0f} | {r['compute_ms'][1]:.0f} | "
              f"{r['wait_ms'][0]:.0f} | {r['wait_ms'][1]:.0f} | {r['slowest_ms']:.0f} | {r['step_ms']:.0f} |")
    for balance, r in results.items():
        print(f"loss, balance {balance}: {_curve(r['losses'])}")
    (Path(args.out) / "measure.json").write_text(json.dumps(results, indent=2))
    return 0


# --- loss curves of the demo run -------------------------------------------------------------------------------------


def run_loss(args) -> int:
    out = Path(args.out)
    common = ["+packing=bfd", f"train.epochs={args.epochs}", f"train.micro_batch_size={args.micro_batch}",
              "train.log_every=1000", f"demo.out_dir={out / 'demo'}"]
    curves = {}
    for balance in ("none", "compute"):
        run_dir = out / f"balance_{balance}"
        train(run_dir, [*common, f"packing.balance={balance}"], nproc=args.nproc)
        curves[balance] = [m["loss"] for m in read_metrics(run_dir)]
        print(f"demo loss, balance {balance}: {_curve(curves[balance])}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
    for ax, (balance, losses) in zip(axes, curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, lw=1)
        ax.set_title(f"packing.balance={balance}")
    for balance, losses in curves.items():
        axes[2].plot(range(1, len(losses) + 1), losses, lw=1, label=balance)
    axes[2].set_title("both")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("loss")
    fig.suptitle(f"demo run (Qwen2-VL tiny, bfd, {args.nproc} rank(s) x micro-batch {args.micro_batch})")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=100)
    (out / "loss_curves.json").write_text(json.dumps(curves))
    print(f"wrote {out / 'loss_curves.png'}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sim = sub.add_parser("simulate")
    for p in (parser, sim):
        p.add_argument("--samples", type=int, default=60_000, help="records of the LLaVA-like mix (video: half)")
        p.add_argument("--mixes", nargs="+", default=["llava", "video"], choices=["llava", "video"])
        p.add_argument("--per-rank", nargs="+", type=int, default=[1, 4], help="packs per rank per optimizer step")
        p.add_argument("--window", type=int, default=64, help="packing.balance_window (steps)")
        p.add_argument("--seed", type=int, default=0)
    measure = sub.add_parser("measure")
    measure.add_argument("--out", default="outputs/bench_balance/measure")
    measure.add_argument("--records", type=int, default=96)
    measure.add_argument("--epochs", type=int, default=1)
    loss = sub.add_parser("loss")
    loss.add_argument("--out", default="outputs/bench_balance/loss")
    loss.add_argument("--epochs", type=int, default=3)
    loss.add_argument("--micro-batch", type=int, default=1)
    loss.add_argument("--nproc", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "measure":
        return run_measure(args)
    if args.command == "loss":
        return run_loss(args)
    return run_simulate(args)


if __name__ == "__main__":
    raise SystemExit(main())
