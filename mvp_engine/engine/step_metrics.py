"""What each optimizer step reports: its ``metrics.jsonl`` record, its console line, and this session's
throughput (FLOPs per second, MFU, per-rank barrier timing) for the summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from mvp_engine.kit.mllm.data import CostProfile, TokenAccounting

from .evaluation import describe

# metrics.jsonl values that depend on the wall clock: the only ones a rerun (or a resume) may not reproduce
WALL_CLOCK_METRICS = ("tokens_per_s", "tflops_per_s", "mfu", "compute_ms", "barrier_wait_ms")


def per_device_tflops(flops: int, seconds: float, world_size: int) -> float:
    """TFLOP/s of one device: a step's FLOPs over all ranks, per second, per rank."""
    return flops / seconds / world_size / 1e12 if seconds else 0.0


def step_record(step: int, epoch: int, loss: float, lr: float, grad_norm: float, counts: TokenAccounting,
                seconds: float, world_size: int, peak_tflops: float | None) -> dict:
    """One ``metrics.jsonl`` line: the step's loss, rate, counts (summed over ranks) and speed."""
    record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
              "effective_tokens": counts.effective, "supervised_tokens": counts.supervised,
              "samples": counts.samples, "packs": counts.packs, "padding_ratio": counts.padding_ratio,
              "tokens_per_s": counts.effective / seconds,
              "model_tflops": counts.model_flops / 1e12,
              "executed_tflops": counts.executed_flops / 1e12,
              "tflops_per_s": per_device_tflops(counts.model_flops, seconds, world_size)}
    if peak_tflops:
        record["mfu"] = record["tflops_per_s"] / peak_tflops
    return record


def barrier_timing_ms(ranks: list[tuple[float, float]]) -> dict:
    """``train.time_barrier``: every rank's compute and barrier wait of a step, in ms."""
    return {"compute_ms": [round(1e3 * compute, 3) for compute, _ in ranks],
            "barrier_wait_ms": [round(1e3 * wait, 3) for _, wait in ranks]}


@dataclass
class Throughput:
    """This session's training steps (a resumed run's earlier ones are not timed here)."""

    model_flops: int = 0
    executed_flops: int = 0
    seconds: float = 0.0
    compute: list[list[float]] = field(default_factory=list)
    wait: list[list[float]] = field(default_factory=list)

    def add(self, record: dict, counts: TokenAccounting, seconds: float) -> None:
        self.model_flops += counts.model_flops
        self.executed_flops += counts.executed_flops
        self.seconds += seconds
        if "compute_ms" in record:
            self.compute.append(record["compute_ms"])
            self.wait.append(record["barrier_wait_ms"])

    def flops_summary(self, totals: TokenAccounting, world_size: int, peak_tflops: float | None,
                      peak_source: str, attention: str, cost_profile: CostProfile) -> dict:
        """FLOPs of the whole run (``totals``) and the rate of this session's steps, with MFU when the device's
        peak is known."""
        rate = per_device_tflops(self.model_flops, self.seconds, world_size)
        return {
            "model_tflops": totals.model_flops / 1e12,
            "executed_tflops": totals.executed_flops / 1e12,
            "step_seconds_this_session": self.seconds,
            "tflops_per_s": rate,
            "executed_tflops_per_s": per_device_tflops(self.executed_flops, self.seconds, world_size),
            "peak_tflops": peak_tflops,
            "peak_source": peak_source,
            "mfu": rate / peak_tflops if peak_tflops else None,
            "attention": attention,
            "cost_profile": cost_profile.to_dict(),
        }

    def barrier_summary(self) -> dict | None:
        """Per-rank mean compute and wait per step under ``train.time_barrier``; None without it."""
        if not self.compute:
            return None
        return {"steps": len(self.compute),
                "compute_ms_per_step": [sum(c) / len(c) for c in zip(*self.compute)],
                "barrier_wait_ms_per_step": [sum(w) / len(w) for w in zip(*self.wait)]}


class StepLog:
    """The main process's step output: ``metrics.jsonl`` lines (each also handed to ``tracker``, the run's
    trackers), a progress bar and a line every ``log_every`` steps; on other ranks it writes nothing."""

    def __init__(self, metrics, progress: tqdm, total_steps: int, log_every: int,
                 tracker: Callable[[dict], None] | None = None):
        self.metrics, self.progress, self.total_steps, self.log_every = metrics, progress, total_steps, log_every
        self.tracker = tracker

    def _line(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker(record)

    def write_eval(self, record: dict) -> None:
        """An evaluation's line (``evaluation.Evaluator``), and its loss on the console."""
        if self.metrics is None:
            return
        self._line(record)
        self.progress.write(f"step {record['step']}/{self.total_steps} {describe(record)}")

    def write(self, record: dict, counts: TokenAccounting) -> None:
        if self.metrics is None:
            return
        self._line(record)
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{record['loss']:.3f}")
        if record["step"] % self.log_every == 0:
            self.progress.write(
                f"step {record['step']}/{self.total_steps} epoch {record['epoch']} loss {record['loss']:.4f} "
                f"lr {record['lr']:.2e} tokens {counts.effective} supervised {counts.supervised} "
                f"samples {counts.samples} padding {counts.padding_ratio:.1%} "
                f"tok/s {record['tokens_per_s']:.0f} TFLOP/s {record['tflops_per_s']:.3g}"
                + (f" MFU {record['mfu']:.1%}" if "mfu" in record else ""))

    def note(self, line: str) -> None:
        if self.metrics is not None:
            self.progress.write(line)

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.progress.close()
