"""End-to-end training throughput: the padded, unpacked baseline against packed training (greedy and bfd).

Why: packing is only worth its complexity if a real training loop (encode, collate, prepare, forward, backward,
optimizer step) trains more real tokens per second. This runs the recipe's own ``Trainer`` on the same tiny
random model and the same demo records in three modes and compares effective (non-padding) tokens/s.

Fairness, and why each choice:

- Same seed, same demo file, same ``data.max_seq_len`` and overlong policy in every mode (the packing config
  interpolates both from ``data``), so exactly the same records are admitted; the tool checks that every mode
  trained the same number of samples and stops otherwise.
- Same token budget per micro-batch, not the same number of rows: a packed row holds many samples, so equal
  rows would hand packing several times more tokens per forward. The padded baseline runs first with
  ``--micro-batch M`` samples per batch; its mean slot count per micro-batch (rows x padded width, from the
  trainer's own accounting) sets the packed micro-batch to ``max(1, round(mean_slots / max_seq_len))`` rows of
  ``max_seq_len``, so packed and padded forwards see about the same number of token slots.
- Warm-up: every mode first trains once on a small separate demo set, so one-off costs (lazy imports, kernel
  selection, allocator growth) do not land on whichever mode runs first.
- Noise: the modes run interleaved for ``--repeats`` rounds and each mode keeps its fastest round (the run
  least disturbed by other processes). ``--threads`` (default 1) fixes torch's intra-op threads: with two
  OpenMP threads on two cores shared with other processes, every parallel region waits for a descheduled
  thread and runs became 10-20x slower at random (measured), which swamps any packing effect.
- One epoch each; the optimizer step counts differ by design (fewer, fuller batches when packed) and are
  printed, as are samples/s, so a change in what was trained cannot hide behind tokens/s.

Two rates are printed per mode. ``tokens/s`` (the target's) is the trainer's summary: effective tokens over the
whole epoch loop, data preparation included. ``step tokens/s`` sums only the trainer's per-step timings
(forward, backward, optimizer; ``metrics.jsonl``), leaving out encoding samples in the main process, which costs
the same in every mode and which a real run overlaps with DataLoader workers.

Target: packed >= 2.0x padded effective tokens/s on the demo mix (each of greedy and bfd); printed as OK/MISS.
What bounds the ratio: packing removes only the padded baseline's padding, so the slot ratio is at most
1 / (1 - padding ratio); costs that follow real tokens or images (vision tower, sample encoding, per-sample Python
work) do not shrink at all. Attention: the baseline runs ``--padded-attention`` (sdpa, as a padded HF run does);
packed runs use ``--packed-attention`` (default ``sdpa_varlen``, per-sample attention costing the sum of squared
segment lengths; with ``sdpa`` a packed row pays a dense L x L block-causal mask, printed for comparison with
``--packed-attention sdpa``).

The default baseline is 16 samples per micro-batch, LLaVA-1.5's per-device batch size; ``--micro-batch 4`` (the
demo config's) pads less (39 %) and so leaves packing less to win.

    python tools/bench_train.py [--recipe qwen2_vl] [--samples 300] [--max-seq-len N] [--micro-batch 16]
        [--repeats 3] [--threads 1] [--packed-attention sdpa_varlen]

``--max-seq-len`` defaults to the recipe config's ``data.max_seq_len`` (1024 for qwen2_vl).

``main(argv)`` returns what it printed as a dict (used by ``tests/test_bench_train.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as ``python tools/bench_train.py`` without an installed package
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mvp_engine.engine.trainer import Trainer  # noqa: E402

CONF_DIR = REPO_ROOT / "conf"
TARGET_RATIO = 2.0
PADDED = "padded"
PACKED_STRATEGIES = ("greedy", "bfd")
WARMUP_SAMPLES = 16


def load_recipe(name: str):
    """The ``RECIPE`` object of ``recipes/<name>/train.py``, the same one its Hydra entry point runs."""
    return importlib.import_module(f"recipes.{name}.train").RECIPE


def compose_config(recipe: str, overrides: list[str]) -> DictConfig:
    """The recipe's primary config with ``overrides``, composed as the Hydra entry point would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=recipe, overrides=overrides)


def common_overrides(args: argparse.Namespace, samples: int, workdir: Path) -> list[str]:
    """What every mode shares: data, limits, seeds, one epoch, no per-step log lines."""
    return [
        f"demo.num_samples={samples}",
        f"demo.out_dir={workdir / f'demo-{samples}'}",
        f"data.max_seq_len={args.max_seq_len}",
        f"data.seed={args.seed}",
        f"train.seed={args.seed}",
        "train.epochs=1",
        "train.gradient_accumulation_steps=1",
        f"train.log_every={10**9}",
        f"train.num_workers={args.num_workers}",
    ]


def mode_overrides(args: argparse.Namespace, mode: str, micro_batch: int, output_dir: Path) -> list[str]:
    """What differs per mode: packing (none for the padded baseline), attention backend, rows per micro-batch."""
    packing = [] if mode == PADDED else [f"+packing={mode}"]
    attention = args.padded_attention if mode == PADDED else args.packed_attention
    return packing + [f"attention={attention}", f"train.micro_batch_size={micro_batch}",
                      f"train.output_dir={output_dir}"]


@contextlib.contextmanager
def _silenced():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield


def train_once(recipe_name: str, overrides: list[str], verbose: bool) -> dict:
    """One ``Trainer(cfg, recipe).run()``; its progress bar and summary line are swallowed unless ``verbose``."""
    cfg = compose_config(recipe_name, overrides)
    with contextlib.nullcontext() if verbose else _silenced():
        return Trainer(cfg, load_recipe(recipe_name)).run()


def step_seconds(output_dir: str) -> float:
    """Time spent inside optimizer steps, summed from the trainer's ``metrics.jsonl`` (excludes data loading)."""
    with open(Path(output_dir) / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return sum(r["effective_tokens"] / r["tokens_per_s"] for r in records if r["tokens_per_s"])


def measure(summary: dict, mode: str, micro_batch: int) -> dict:
    """The numbers compared across modes, all from the trainer's own accounting and timers."""
    totals = summary["totals"]
    seconds = summary["seconds"]
    in_steps = step_seconds(summary["output_dir"])
    return {
        "mode": mode,
        "micro_batch": micro_batch,
        "steps": summary["actual_steps"],
        "batches": totals["batches"],
        "packs": totals["packs"],
        "samples": totals["samples"],
        "effective_tokens": totals["effective"],
        "slots": totals["slots"],
        "padding_ratio": totals["padding_ratio"],
        "dropped": totals["dropped_total"],
        "seconds": seconds,
        "tokens_per_s": summary["effective_tokens_per_s"],
        "samples_per_s": totals["samples"] / seconds if seconds else 0.0,
        "step_seconds": in_steps,
        "step_tokens_per_s": totals["effective"] / in_steps if in_steps else 0.0,
    }


def packed_micro_batch(padded: dict, max_seq_len: int) -> int:
    """Rows of ``max_seq_len`` holding about as many slots as the padded baseline's mean micro-batch."""
    mean_slots = padded["slots"] / max(1, padded["batches"])
    return max(1, round(mean_slots / max_seq_len))


def run_mode(args: argparse.Namespace, workdir: Path, samples: int, mode: str, micro_batch: int, tag: str) -> dict:
    overrides = common_overrides(args, samples, workdir) + mode_overrides(args, mode, micro_batch, workdir / tag)
    return measure(train_once(args.recipe, overrides, args.verbose), mode, micro_batch)


def warm_up(args: argparse.Namespace, workdir: Path) -> None:
    """Train every mode once on a few samples so first-call costs are paid before anything is timed."""
    for mode in (PADDED, *PACKED_STRATEGIES):
        run_mode(args, workdir, WARMUP_SAMPLES, mode, args.micro_batch if mode == PADDED else 1, "warmup")


def run_rounds(args: argparse.Namespace, workdir: Path) -> list[dict]:
    """``--repeats`` interleaved rounds of every mode; each mode keeps its fastest run.

    The padded baseline of the first round sizes the packed micro-batch for all rounds.
    """
    best: dict[str, dict] = {}
    rows = None
    for round_index in range(args.repeats):
        for mode in (PADDED, *PACKED_STRATEGIES):
            micro_batch = args.micro_batch if mode == PADDED else rows
            result = run_mode(args, workdir, args.samples, mode, micro_batch, f"{mode}-{round_index}")
            if mode == PADDED and rows is None:
                rows = packed_micro_batch(result, args.max_seq_len)
            if mode not in best or result["seconds"] < best[mode]["seconds"]:
                best[mode] = result
    return [best[mode] for mode in (PADDED, *PACKED_STRATEGIES)]


def check_same_samples(results: list[dict]) -> None:
    """Every mode must have trained the same samples, or the comparison means nothing."""
    counts = {r["mode"]: (r["samples"], r["effective_tokens"], r["dropped"]) for r in results}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"modes trained different data (samples, effective tokens, dropped): {counts}")


def format_row(r: dict, max_seq_len: int) -> str:
    shape = f"{r['micro_batch']} samples" if r["mode"] == PADDED else f"{r['micro_batch']} x {max_seq_len}"
    return (f"{r['mode']:7s} micro-batch {shape:11s} steps {r['steps']:5d}  samples {r['samples']:6d}  "
            f"effective tokens {r['effective_tokens']:8d}  padding {r['padding_ratio']:6.1%}  "
            f"seconds {r['seconds']:7.2f}  tokens/s {r['tokens_per_s']:9.1f}  samples/s {r['samples_per_s']:8.2f}  "
            f"step tokens/s {r['step_tokens_per_s']:9.1f}")


def ratios(results: list[dict], key: str) -> dict[str, float]:
    padded = results[0][key]
    return {r["mode"]: (r[key] / padded if padded else 0.0) for r in results[1:]}


def report(args: argparse.Namespace, results: list[dict], seconds: float) -> dict:
    """Print the table and one ratio line per strategy; return everything printed as a dict."""
    padded = results[0]
    print(f"recipe {args.recipe}, {args.samples} demo samples, max_seq_len {args.max_seq_len}, seed {args.seed}, "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}; padded micro-batch {args.micro_batch} "
          f"samples (mean {padded['slots'] / max(1, padded['batches']):.0f} slots) vs packed "
          f"{results[1]['micro_batch']} x {args.max_seq_len}; attention padded {args.padded_attention}, packed "
          f"{args.packed_attention}")
    for r in results:
        print(format_row(r, args.max_seq_len))
    token_ratios, step_ratios = ratios(results, "tokens_per_s"), ratios(results, "step_tokens_per_s")
    for mode, ratio in token_ratios.items():
        verdict = "OK" if ratio >= TARGET_RATIO else "MISS"
        print(f"{mode}/padded effective tokens/s: {ratio:.3f}x (target >= {TARGET_RATIO}x) -> {verdict}; "
              f"step tokens/s {step_ratios[mode]:.3f}x")
    print(f"bench time {seconds:.1f} s (warm-up included)")
    return {"results": results, "ratios": token_ratios, "step_ratios": step_ratios, "target": TARGET_RATIO,
            "ok": all(ratio >= TARGET_RATIO for ratio in token_ratios.values()), "seconds": seconds}


def fill_config_defaults(args: argparse.Namespace) -> None:
    """Unset ``--max-seq-len`` / ``--micro-batch`` mean what the recipe trains with: its config's values."""
    if args.max_seq_len is None or args.micro_batch is None:
        cfg = compose_config(args.recipe, [])
        args.max_seq_len = args.max_seq_len or int(cfg.data.max_seq_len)
        args.micro_batch = args.micro_batch or int(cfg.train.micro_batch_size)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="qwen2_vl", help="recipes/<name>/train.py and conf/<name>.yaml")
    parser.add_argument("--samples", type=int, default=300, help="demo.num_samples")
    parser.add_argument("--max-seq-len", type=int, help="data.max_seq_len, packs use the same (default: config's)")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="samples per padded micro-batch (default 16, LLaVA-1.5's per-device batch)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each mode keeps its fastest")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="train.num_workers for every mode: encoding overlaps compute, as in a real run")
    parser.add_argument("--padded-attention", default="sdpa", help="attention backend of the padded baseline")
    parser.add_argument("--packed-attention", default="sdpa_varlen",
                        help="attention backend of the packed runs (sdpa_varlen: per-sample attention, no L x L mask)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    parser.add_argument("--verbose", action="store_true", help="show the trainer's progress bars and summaries")
    args = parser.parse_args(argv)
    fill_config_defaults(args)
    for name in ("samples", "max_seq_len", "micro_batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
            workdir = Path(tmp)
            if not args.no_warmup:
                warm_up(args, workdir)
            results = run_rounds(args, workdir)
        check_same_samples(results)
        return report(args, results, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process by the tests


if __name__ == "__main__":
    main()
