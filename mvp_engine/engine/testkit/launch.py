"""Real training launches (``python -m recipes.<name>.train`` for one process, ``torch.distributed.run`` (torchrun)
for several, each with a timeout so a hang fails instead of blocking CI: the benches' runs), the environment every
training of the suite runs in, its training counts, and reading a run's metrics, summary and final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import CONF_DIR
from ..device import DEVICE_ENV

REPO_ROOT = CONF_DIR.parent
# every launch on one thread per process: results do not depend on how many cores the machine has free; and on the
# CPU: the tests' trainings make CPU claims (gloo, exact equalities), and on a GPU machine two ranks would be two
# NCCL ranks on one GPU (``device.py``)
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", DEVICE_ENV: "cpu"}
# every kit training decodes on its training thread: train.num_workers=auto would start loader processes for each
# epoch of each run (up to 4 per rank on a large CI machine), which runs of a few steps never repay; any count gives
# the same batches, and a test's own train.num_workers, given after these, still wins
KIT_OVERRIDES = ("train.num_workers=0",)
# trainings of this test session by how they ran: "launched" (a fresh interpreter per process, here), "in-process",
# "pooled" and "forked" (``runs.py``); printed at the session's end
RUN_COUNTS: Counter = Counter()
# set by ``make test-fast``: a test that starts processes there is missing its ``launch`` marker
NO_LAUNCH_ENV = "VLM_PACKING_NO_LAUNCH"


def count_launch(how: str) -> None:
    """Count a training (``how``: launched / pooled / forked / in-process); starting processes is refused in the
    fast lane."""
    if how != "in-process" and os.environ.get(NO_LAUNCH_ENV) == "1":
        raise AssertionError(f"this test starts processes ({how}) in the fast lane: mark it `launch` or `slow`")
    RUN_COUNTS[how] += 1


def train_command(recipe: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", f"recipes.{recipe}.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", f"recipes.{recipe}.train"]


def run_overrides(run_dir: Path, overrides: list[str] | tuple[str, ...]) -> list[str]:
    return [f"hydra.run.dir={run_dir}", *overrides]


def launch(recipe: str, run_dir: Path, overrides=(), nproc: int = 1, timeout: float = 300,
           command: list[str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a training to its end; ``check``: fail with its output unless it exited 0."""
    cmd = (command or train_command(recipe, nproc)) + run_overrides(run_dir, [*KIT_OVERRIDES, *overrides])
    count_launch("launched")
    # its own session: a launch that hangs is killed with every rank it started (killing torchrun alone would
    # leave its ranks running after the test)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env={**os.environ, **LAUNCH_ENV}, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s:\n{stdout[-3000:]}\n"
                             f"{stderr[-6000:]}") from None
    result = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without the wall-clock columns, the only values a rerun may not reproduce."""
    from ..step_metrics import WALL_CLOCK_METRICS

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        for key in WALL_CLOCK_METRICS:
            line.pop(key, None)
    return lines


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
