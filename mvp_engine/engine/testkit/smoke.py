"""Smoke checks: a few real training steps per packing strategy on the demo data, honestly accounted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..demo import with_demo_data
from ..trainer import Trainer
from .launch import KIT_OVERRIDES
from .runs import session_demo_dir
from .structure import compose_config, load_recipe, packing_overrides


def smoke_trainer(name: str, packing: str | None, output_dir: Path, overrides: tuple[str, ...] = ()) -> Trainer:
    """The trainer of a short real training run on the demo data, built and not yet run (a test that needs the
    trained model in memory runs it itself). The demo set is the session's for its settings, so it is written
    (images and clips) and measured once, not per test."""
    cfg = compose_config(name, [
        *packing_overrides(packing), "demo.num_samples=48", "data.max_seq_len=512", "train.epochs=2",
        "train.micro_batch_size=2", "train.learning_rate=5e-3", "train.warmup_ratio=0.0",
        f"train.output_dir={output_dir}", *KIT_OVERRIDES, *overrides,
    ])
    if not any(o.startswith("demo.out_dir=") for o in overrides):
        cfg.demo.out_dir = str(session_demo_dir(cfg.demo.num_samples, cfg.demo.seed, cfg.demo.videos))
    return Trainer(with_demo_data(cfg), load_recipe(name))


def smoke_run(name: str, packing: str | None, output_dir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """A short real training run on the demo data; returns the summary plus the planned totals to check."""
    trainer = smoke_trainer(name, packing, output_dir, overrides)
    summary = trainer.run()
    plans = [trainer.dataset.plan(epoch) for epoch in range(trainer.specs.train.epochs)]
    summary["planned"] = {
        "samples": sum(len(p) for plan in plans for p in plan.packs),
        "packs": sum(len(plan.packs) for plan in plans),
        "effective": sum(plan.lengths[i] for plan in plans for p in plan.packs for i in p),
        "dropped": dict(sum((plan.drop_counts for plan in plans), Counter())),
    }
    return summary


def check_smoke_summary(summary: dict) -> None:
    """Finite, falling loss; the run trained exactly what was planned; the step estimate held."""
    losses = summary["losses"]
    assert losses and all(x == x and abs(x) != float("inf") for x in losses), f"non-finite loss in {losses}"
    assert summary["loss_last"] < summary["loss_first"], f"loss did not fall: {losses}"
    assert summary["actual_steps"] == summary["estimated_steps"]
    totals, planned = summary["totals"], summary["planned"]
    assert totals["samples"] == planned["samples"]
    assert totals["packs"] == planned["packs"]
    assert totals["effective"] == planned["effective"]
    assert totals["dropped"] == planned["dropped"]
    assert 0 <= totals["padding_ratio"] < 1
