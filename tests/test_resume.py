"""Checkpoints and resume, for real: a resumed run logs exactly the metrics the uninterrupted run logged.

References run with a checkpoint after every step; resumes start from one of those (mid-epoch or at the epoch
boundary) under another ``num_workers``, or from whatever a SIGKILLed or SIGTERMed run left behind (its ranks
forked processes, ``kit.start_forked``). 1 and 2 processes (gloo), greedy (streaming dataset) and bfd (map-style
dataset). Resuming on another world size: ``tests/test_elastic.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, STATE_FILE, load_run_state

RECIPE = "qwen2_vl"
COVERS = ("resume", "DDP", "FSDP2")  # on RECIPE, for the coverage table (testkit.coverage)
pytestmark = pytest.mark.slow


def common(data: Path, packing: str) -> list[str]:
    return [f"+packing={packing}", f"data.sources=[{data}]", "data.max_seq_len=160", "train.epochs=2",
            "train.micro_batch_size=1", "train.learning_rate=5e-3", "train.warmup_ratio=0.2", "train.keep_last=100"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return kit.write_mixed_jsonl(tmp_path_factory.mktemp("resume_data"), num_records=31)


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """Uninterrupted runs per (processes, packing, sharding), made on first use: unsharded ones with a checkpoint
    after every step (the resumes start from them), the FSDP2 one without (only its metrics are compared, and an
    FSDP2 checkpoint per step was most of its cost)."""
    made: dict[tuple[int, str, str], Path] = {}

    def get(nproc: int, packing: str, sharding: str = "none") -> Path:
        if (nproc, packing, sharding) not in made:
            run_dir = tmp_path_factory.mktemp(f"reference_{nproc}_{packing}_{sharding}")
            every_step = ["train.save_every_steps=1"] if sharding == "none" else []
            kit.train(RECIPE, run_dir, [*common(data, packing), *every_step, f"train.sharding={sharding}"],
                      nproc=nproc)
            made[nproc, packing, sharding] = run_dir
        return made[nproc, packing, sharding]

    return get


def resume_point(metrics: list[dict], where: str) -> int:
    """The step to resume after: the middle of the first epoch, or its last step."""
    first_epoch = [m["step"] for m in metrics if m["epoch"] == 0]
    return first_epoch[len(first_epoch) // 2] if where == "mid" else first_epoch[-1]


# Each packing resumed mid-epoch and at the boundary, under both world sizes and both worker counts, over three
# references (the other tests share (1, bfd) and (2, greedy)): the full cross product would double CI time.
@pytest.mark.parametrize("packing,where,workers,nproc", [("greedy", "mid", 2, 2), ("greedy", "boundary", 0, 2),
                                                          ("bfd", "mid", 0, 2), ("bfd", "boundary", 2, 1)])
def test_resume_from_a_checkpoint_reproduces_the_rest_of_the_run(references, data, tmp_path, nproc, packing, where,
                                                                 workers):
    reference = references(nproc, packing)
    expected = kit.read_metrics(reference)
    step = resume_point(expected, where)
    checkpoint = reference / CHECKPOINTS / f"step_{step:08d}"
    state = load_run_state(checkpoint)
    assert (state.epoch, state.epoch_steps_done > 0) == ((0, True) if where == "mid" else (1, False))
    kit.train(RECIPE, tmp_path, [*common(data, packing), f"train.resume_from={checkpoint}",
                                 f"train.num_workers={workers}"], nproc=nproc)
    assert kit.read_metrics(tmp_path) == expected[step:]
    summary, full = kit.read_summary(tmp_path), kit.read_summary(reference)
    assert summary["losses"] == full["losses"] and summary["totals"] == full["totals"]
    assert kit.max_weight_difference(kit.final_weights(tmp_path), kit.final_weights(reference)) == 0


def test_a_compute_balanced_epoch_trains_the_same_samples_and_times_each_ranks_wait(references, data, tmp_path):
    """``packing.balance=compute`` over a streamed (greedy) plan on 2 ranks with ``train.time_barrier=true``: the same
    samples and step count as the round-robin run, each rank's compute and barrier wait logged every step (resuming a
    balanced epoch mid-way: ``tests/test_balance.py``, through the same ``starting_at``)."""
    kit.train(RECIPE, tmp_path, [*common(data, "greedy"), "train.epochs=1", "packing.balance=compute",
                                 "packing.balance_window=2", "train.time_barrier=true"], nproc=2)
    raw = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["compute_ms"]) == 2 and len(m["barrier_wait_ms"]) == 2 for m in raw)
    summary, plain = kit.read_summary(tmp_path), kit.read_summary(references(2, "greedy"))
    assert summary["barrier_timing"]["steps"] == len(raw) == summary["actual_steps"] == summary["estimated_steps"]
    assert summary["epochs"][0] == plain["epochs"][0]  # every record trained, dropped or bad exactly as round-robin
    assert len(raw) == len([m for m in kit.read_metrics(references(2, "greedy")) if m["epoch"] == 0])


@pytest.mark.parametrize("nproc,packing,sharding", [(1, "bfd", "none"), (2, "greedy", "none"), (2, "greedy", "fsdp2")])
def test_sigkill_then_resume_auto_reproduces_the_uninterrupted_run(references, data, tmp_path, nproc, packing,
                                                                   sharding):
    """Under FSDP2 too: every rank's shards of model and optimizer come back from its own DCP file. The killed ranks
    are forked training processes (``kit.start_forked``), SIGKILLed at once wherever they are."""
    expected = kit.read_metrics(references(nproc, packing, sharding))
    overrides = [*common(data, packing), "train.save_every_steps=2", "train.keep_last=1", f"train.sharding={sharding}"]
    run = kit.start_forked(RECIPE, tmp_path, overrides, nproc=nproc)
    run.wait_until(lambda: (tmp_path / CHECKPOINTS / "step_00000002").is_dir())
    run.kill()
    assert not (tmp_path / "summary.json").exists(), "the run finished before it was killed"
    logged = kit.read_metrics(tmp_path)
    assert logged == expected[:len(logged)], "metrics.jsonl holds every step trained before the kill"
    kept = sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir() if not p.name.startswith("."))
    assert len(kept) == 1, f"keep_last=1 left {kept}"
    kit.train(RECIPE, tmp_path, [*overrides, "train.resume_from=auto"], nproc=nproc)
    assert kit.read_metrics(tmp_path) == expected
    assert kit.read_summary(tmp_path)["resumed_from"].endswith(kept[0])


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint_and_exit_0(references, data, tmp_path):
    """What a scheduler's preemption does to one rank (forked ranks, ``kit.start_forked``): the other stops at the
    same step, both save and exit 0 inside torchrun's 30 s grace period."""
    expected = kit.read_metrics(references(2, "greedy"))
    overrides = common(data, "greedy")
    run = kit.start_forked(RECIPE, tmp_path, overrides, nproc=2)
    run.wait_until(lambda: (tmp_path / "metrics.jsonl").is_file() and len(kit.read_metrics(tmp_path)) >= 2)
    signalled = time.monotonic()
    os.kill(run.ranks[1].pid, signal.SIGTERM)
    statuses = run.wait(timeout=120)
    stop_seconds = time.monotonic() - signalled
    assert statuses == [0, 0], run.stderr()[-4000:]
    summary = kit.read_summary(tmp_path)
    assert summary["stopped_by"] == "SIGTERM" and summary["actual_steps"] < len(expected)
    assert summary["steps_per_rank_this_session"][0] == summary["steps_per_rank_this_session"][1]
    assert (tmp_path / CHECKPOINTS / f"step_{summary['actual_steps']:08d}" / STATE_FILE).is_file()
    assert not (tmp_path / "model").exists(), "a preempted run leaves a checkpoint, not a final model"
    assert stop_seconds < 30, f"stopping took {stop_seconds:.1f} s, more than torchrun's grace period"
    print(f"SIGTERM to rank 1 -> both ranks saved step {summary['actual_steps']} and exited 0 in {stop_seconds:.1f} s")
    kit.train(RECIPE, tmp_path, [*overrides, "train.resume_from=auto"], nproc=2)
    assert kit.read_metrics(tmp_path) == expected


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_usable(references, data, tmp_path):
    reference = references(1, "bfd")
    run_dir = tmp_path / "run"
    (run_dir / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(reference / CHECKPOINTS / "step_00000002", run_dir / CHECKPOINTS / "step_00000002")
    half_written = run_dir / CHECKPOINTS / ".step_00000003.partial"
    shutil.copytree(reference / CHECKPOINTS / "step_00000003", half_written)
    (half_written / "__0_0.distcp").write_bytes(b"truncated")
    kit.train(RECIPE, run_dir, [*common(data, "bfd"), "train.resume_from=auto"])
    assert kit.read_metrics(run_dir) == kit.read_metrics(reference)[2:]
