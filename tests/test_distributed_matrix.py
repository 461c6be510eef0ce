"""The engine's reduction x sharding matrix, on real 2-rank gloo runs of the tiny LLaVA: 2 ranks x accumulation 1
train exactly what 1 rank x accumulation 2 trains, for every loss reduction (token unpacked, sample greedy, square
bfd), under DDP and FSDP2, on data whose micro-batches alternate image and text-only samples and whose last step is
uneven (one rank trains an all-padding row). The reductions and the sharding are model-free: one recipe carries the
matrix, every recipe carries its own 2-rank contract (``DistributedSuite``). The 1-rank references are shared by
the DDP and FSDP2 cases (``kit.cached_run``)."""

from __future__ import annotations

import pytest

import mvp_engine.engine.testing as kit

RECIPE = "llava"
COVERS = ("DDP", "FSDP2")  # on RECIPE, for the coverage table (testkit.coverage)
CASES = {"token": None, "sample": "greedy", "square": "bfd"}  # reduction -> packing (None: unpacked)
TOLERANCES = {"none": 1e-6, "fsdp2": 1e-5}  # FSDP2 reduce-scatters: the sums run in another order
pytestmark = [pytest.mark.slow, pytest.mark.launch]


def common(reduction: str) -> list[str]:
    return [*kit.packing_overrides(CASES[reduction]), f"data.sources=[{kit.shared_mixed_jsonl()}]",
            "data.shuffle=false", "data.max_seq_len=160", "train.epochs=2", "train.micro_batch_size=1",
            "train.learning_rate=5e-3", "train.warmup_ratio=0.2", f"train.loss_reduction={reduction}"]


@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
@pytest.mark.parametrize("reduction", list(CASES))
def test_two_ranks_train_what_one_rank_accumulating_two_trains(reduction, sharding, tmp_path):
    out = kit.train(RECIPE, tmp_path, [*common(reduction), f"train.sharding={sharding}",
                                       "train.gradient_accumulation_steps=1"], nproc=2).stdout
    one_dir = kit.cached_run(RECIPE, [*common(reduction), "train.gradient_accumulation_steps=2"])
    two, one = kit.read_metrics(tmp_path), kit.read_metrics(one_dir)
    assert [m["lr"] for m in two] == [m["lr"] for m in one]
    assert [m["samples"] for m in two] == [m["samples"] for m in one]
    tol = TOLERANCES[sharding]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(two, one)) <= tol
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(two, one)) <= 10 * tol
    difference = kit.max_weight_difference(kit.final_weights(tmp_path), kit.final_weights(one_dir))
    assert difference <= tol, f"parameters differ by {difference}"
    summary = kit.read_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["sharding"] == sharding
    assert ("sharding: fsdp2 over 2 ranks" in out) == (sharding == "fsdp2"), out
    assert summary["steps_per_rank_this_session"] == [summary["estimated_steps"]] * 2 == [len(two)] * 2
    assert summary["parameters"] == kit.read_summary(one_dir)["parameters"]
    if CASES[reduction] is None:  # 11 samples on 2 ranks: the last step pairs a sample with an all-padding row
        assert [m["packs"] for m in two][-1] == 1


def test_fsdp2_syncing_on_a_step_s_last_micro_batch_trains_what_syncing_every_micro_batch_trains(tmp_path):
    """``train.grad_sync=last`` reduce-scatters the summed gradients of an accumulation window once instead of each
    micro-batch's: the same sum in another order. (Which costs less on a GPU, the reduce-scatters or the unsharded
    fp32 gradients held until the last micro-batch, only a GPU can tell: ``every`` stays the default.) The start
    line says how many loader processes each rank runs: the test kit pins 0."""
    runs = {}
    for sync in ("every", "last"):
        out = kit.train(RECIPE, tmp_path / sync, [*common("token"), "train.sharding=fsdp2",
                                                  "train.gradient_accumulation_steps=2", f"train.grad_sync={sync}"],
                        nproc=2).stdout
        assert "torch threads 1, data workers 0;" in out, out
        runs[sync] = kit.read_metrics(tmp_path / sync)
    every, last = runs["every"], runs["last"]
    assert len(every) == len(last) >= 4 and [m["samples"] for m in every] == [m["samples"] for m in last]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(every, last)) <= 1e-6
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(every, last)) <= 1e-6


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_fsdp2_with_its_shards_offloaded_to_the_host_trains_what_one_rank_trains(offload, tmp_path):
    """``train.offload=params`` (FSDP2's CPUOffloadPolicy): shards, gradients and optimizer state in host memory;
    ``optimizer`` (``host_optimizer.HostAdamW``): AdamW's state and update on the host, shards and gradients on the
    device. On this CPU-only machine host and device are the same memory, so what this checks is that the offload is
    applied (params: the start line says so; optimizer: ``tests/test_sharding.py`` checks the optimizer this setting
    builds) and that the run trains what the unsharded, non-offloaded 1-rank reference trains; the copies to and
    from a GPU are only exercised on CUDA."""
    out = kit.train(RECIPE, tmp_path, [*common("token"), "train.sharding=fsdp2", f"train.offload={offload}",
                                       "train.gradient_accumulation_steps=1"], nproc=2).stdout
    shards_offloaded = "offloaded to host memory with their gradients and optimizer state" in out
    assert shards_offloaded == (offload == "params"), out
    one_dir = kit.cached_run(RECIPE, [*common("token"), "train.gradient_accumulation_steps=2"])
    two, one = kit.read_metrics(tmp_path), kit.read_metrics(one_dir)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(two, one)) <= TOLERANCES["fsdp2"]
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(two, one)) <= 10 * TOLERANCES["fsdp2"]
    assert kit.max_weight_difference(kit.final_weights(tmp_path), kit.final_weights(one_dir)) <= TOLERANCES["fsdp2"]
