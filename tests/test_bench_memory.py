"""tools/bench_memory.py: what it computes, on known models and tiny sizes.

Checked: the state count of fp32 AdamW after a step is 4x the trainable parameters' bytes (plus its step
counters), frozen parameters count once; OK/MISS are decided by the targets; one tiny run of the command (its
``main``, in this process) on its own 2 ranks returns, and its numbers hold together: DDP's ranks each hold
everything, FSDP2's shards add up to exactly DDP's parameters and hold about half per rank, recomputation saves
bytes and trains the same; ``--experts`` counts each rank's expert state from its tensors (EP 2 holds half the
experts' weights, gradients and moments); ``--loss`` and ``--step`` measure the chunked loss below the full one,
alone and in a whole step. Wall-clock values are never asserted; the printed table is formatting and
is not parsed.
"""

from __future__ import annotations

import json

import pytest
import torch

from mvp_engine.engine.testing import LAUNCH_ENV
from mvp_engine.engine.testkit.runs import spawn_on_pool
from tools import bench_memory as bench

TINY = ["--length", "512", "--state-length", "256", "--samples", "16", "--hidden", "64", "--intermediate", "128",
        "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vision-hidden", "32", "--vision-intermediate", "64",
        "--vision-layers", "2", "--vision-heads", "2", "--repeats", "1"]


def test_fp32_adamw_state_after_a_step_is_four_times_the_trainable_bytes():
    trained, frozen = torch.nn.Linear(64, 32), torch.nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model = torch.nn.Sequential(trained, frozen)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    torch.nn.Sequential(trained, torch.nn.Linear(32, 8), frozen)(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    trainable, fixed = (64 * 32 + 32) * 4, (8 * 8 + 8) * 4
    counters = 2 * 4  # AdamW's fp32 ``step`` of the weight and of the bias
    assert bench.state_bytes(model, optimizer) == {"parameters": trainable + fixed, "gradients": trainable,
                                                   "optimizer": 2 * trainable + counters,
                                                   "total": 4 * trainable + fixed + counters}


def state(ddp_total: int, fsdp_totals: list[int]) -> dict:
    return {"ddp": [{"total": ddp_total}] * 2, "fsdp2": [{"total": t} for t in fsdp_totals]}


@pytest.mark.parametrize(("fsdp_totals", "saved_ratio", "expected"), [
    ([500, 550], 0.3, [True, True]),
    ([500, 551], 0.1, [False, True]),  # the worst rank decides
    ([500, 500], 0.31, [True, False]),
])
def test_ok_and_miss_are_decided_by_the_targets(fsdp_totals, saved_ratio, expected):
    found = bench.targets(state(1000, fsdp_totals), {"saved_ratio": saved_ratio})
    assert [t["ok"] for t in found] == expected
    assert [t["line"].endswith("OK" if ok else "MISS") for t, ok in zip(found, expected)] == [True, True]


@pytest.mark.launch
def test_the_command_measures_on_two_ranks_and_its_numbers_hold(tmp_path, monkeypatch, capfd):
    """The command's ``main`` with its arguments, in this process (a fresh interpreter for it cost ~8 s of imports),
    in the environment and folder a launch would have; its two ranks (``torch.multiprocessing.spawn``) run on the
    session's pooled ranks (``spawn_on_pool``): what a rank holds after its step is counted from its tensors,
    whichever process started it, and two fresh interpreters cost ~10 s of imports."""
    for key, value in LAUNCH_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn_on_pool)
    out = tmp_path / "bench.json"
    returned = bench.main([*TINY, "--workdir", "work", "--json", str(out)])
    stdout = capfd.readouterr().out
    numbers = json.loads(out.read_text())
    ddp, fsdp = numbers["state"]["ddp"], numbers["state"]["fsdp2"]
    activations = numbers["activations"]
    assert ddp[0] == ddp[1]  # every rank holds all of it
    assert ddp[0]["parameters"] == 4 * activations["parameters"] and ddp[0]["gradients"] == 4 * activations["trainable"]
    assert 2 * ddp[0]["gradients"] < ddp[0]["optimizer"] < 2 * ddp[0]["gradients"] + 4 * 1024
    assert sum(rank["parameters"] for rank in fsdp) == ddp[0]["parameters"]  # the shards partition the model
    assert sum(rank["gradients"] for rank in fsdp) == ddp[0]["gradients"]
    assert 0.45 < numbers["state_ratio"] <= bench.TARGET_STATE_RATIO
    assert activations["checkpointing"]["saved_bytes"] < activations["none"]["saved_bytes"]
    assert activations["loss_diff"] <= bench.EXACT_TOL and activations["grad_diff"] <= bench.EXACT_TOL
    assert numbers["targets"][0]["ok"]
    assert numbers["lines"] == returned["lines"] == stdout.splitlines()


def test_the_loss_mode_measures_chunked_below_full_and_computes_what_does_not_fit(capsys):
    """``--loss`` at tiny sizes: full runs where its computed size fits the budget and is printed as computed where
    not; the chunked loss's measured peak is far below full's at the same size (wall-clock is never asserted)."""
    result = bench.main(["--loss", "--vocabs", "4096", "--lengths", "256", "1024", "--chunk-tokens", "64",
                         "--budget-gib", str(12 * 512 * 4096 / 2**30)])
    small, large = result["rows"]
    assert small["full"] is not None and large["full"] is None
    assert small["chunked"]["peak_bytes"] * 3 < small["full"]["peak_bytes"]
    assert large["chunked"]["peak_bytes"] < large["full_computed_bytes"] / 10
    assert "does not fit" in capsys.readouterr().out
    assert [t["name"] for t in result["targets"]] == ["chunked_peak", "chunked_time"]


@pytest.mark.launch
def test_the_experts_mode_counts_each_ranks_expert_state_from_its_tensors(tmp_path, monkeypatch):
    """``--experts`` at tiny sizes (4 experts of intermediate 32, 2 MoE layers of hidden 64) on the session's 2
    pooled ranks: each rank's expert bytes after its AdamW step are the experts' fp32 weights, gradients and both
    moments over the EP size plus AdamW's step counters (one 4-byte counter per expert weight), for EP 1 (``none``)
    and EP 2 alike; so the ratio it reports is the worst rank's EP 2 / none of those tensors (just above 1 / 2:
    the counters stay whole), under the 0.55 target, and everything else a rank holds is the same in both modes."""
    for key, value in LAUNCH_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn_on_pool)
    experts, intermediate, hidden, layers = 4, 32, 64, 2
    result = bench.main(["--experts", "--num-experts", str(experts), "--moe-intermediate", str(intermediate),
                         "--state-length", "128", "--samples", "8", "--workdir", "work"])
    weights = layers * experts * 3 * hidden * intermediate * 4  # gate_up [E, 2i, h] and down [E, h, i], fp32
    counters = layers * 2 * 4

    def expected(ep_size: int) -> int:
        return 4 * weights // ep_size + counters  # weights, gradients, exp_avg, exp_avg_sq

    ranks = result["ranks"]
    assert [rank["none"]["experts"] for rank in ranks] == [expected(1)] * 2
    assert [rank["ep2"]["experts"] for rank in ranks] == [expected(2)] * 2
    assert all(r["none"]["total"] - r["none"]["experts"] == r["ep2"]["total"] - r["ep2"]["experts"] for r in ranks)
    assert result["ratio"] == expected(2) / expected(1) <= bench.TARGET_STATE_RATIO
    assert result["ok"] and result["targets"][0]["line"].endswith("OK")


def test_the_step_mode_measures_a_whole_step_with_each_loss(tmp_path):
    """``--step`` at tiny sizes: one step of the widened model (vocabulary widened) with each loss on the same
    weights: the same loss, the chunked step's measured peak below the full one's, the target decided by it."""
    result = bench.main(["--step", "--step-length", "512", "--step-vocab", "4096", "--step-samples", "32",
                         "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                         "--vision-hidden", "32", "--vision-intermediate", "64", "--vision-layers", "2",
                         "--vision-heads", "2", "--workdir", str(tmp_path)])
    step = result["step"]
    assert step["loss_rel_diff"] <= 1e-5
    assert 0 < step["chunked"]["peak_bytes"] < step["full"]["peak_bytes"]
    assert step["ratio"] == step["full"]["peak_bytes"] / step["chunked"]["peak_bytes"]
    assert result["ok"] == (step["ratio"] >= bench.TARGET_STEP_PEAK_RATIO) == result["targets"][0]["ok"]
