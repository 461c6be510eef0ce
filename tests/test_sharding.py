"""``train.sharding=fsdp2`` where it cannot run stops with one line; the gradient norm is exact to fp32 rounding
without a float64 copy of any gradient.

The training equivalence (2 sharded ranks == 1 rank accumulating), the save / load round trip and loading a
pretrained folder on rank 0 alone are in every recipe's ``DistributedSuite`` (real 2-process launches)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, TrainSpec
from mvp_engine.engine.entry import run_recipe
from mvp_engine.engine.host_optimizer import HostAdamW
from mvp_engine.engine.sharding import clip_grad_norm_, offloaded, shard_model
from mvp_engine.engine.train_step import TrainStep, optimizer_and_schedule


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_a_model_without_blocks_to_shard_is_refused_with_one_line(one_process_group):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"^train.sharding=fsdp2: Sequential declares no blocks to shard "
                                          r"\(_no_split_modules is empty or matches no module\)"):
        shard_model(model, "no")


def test_fsdp2_without_a_launcher_is_refused_with_one_line(tmp_path, capsys):
    cfg = kit.compose_config("llava", ["train.sharding=fsdp2", "demo.num_samples=8", f"train.output_dir={tmp_path}",
                                       f"demo.out_dir={tmp_path / 'demo'}"])
    with pytest.raises(SystemExit):
        run_recipe(cfg, kit.load_recipe("llava"))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("config error: train.sharding=fsdp2 needs several processes: launch with torchrun"), last


def test_the_gradient_norm_is_summed_in_float64():
    """A float32 sum of 200k squares drifts by ~1e-5 relative on the CPU; the clipped norm must not."""
    grad = torch.linspace(-1.0, 1.0, 200_000) ** 3 + 1e-3
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    exact = float(grad.double().norm())
    total = clip_grad_norm_([param], max_norm=1.0)
    assert abs(float(total) - exact) <= 1e-7 * exact
    assert abs(float(param.grad.double().norm()) - 1.0) <= 1e-6


def test_the_gradient_norm_makes_no_float64_copy_of_a_gradient():
    """A float64 copy of each gradient was a 4.4 GB spike for a 7B model's embedding; the norm reads the gradients
    in place: no allocation of even 1 % of a gradient's bytes (the profiler records the CPU's allocations)."""
    param = torch.nn.Parameter(torch.zeros(1_000_003))
    param.grad = torch.randn(1_000_003)
    exact = float(param.grad.double().norm())
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as profile:
        total = clip_grad_norm_([param], max_norm=1e9)
    largest = max(event.cpu_memory_usage for event in profile.function_events)
    assert largest < param.grad.nbytes // 100, f"an allocation of {largest} bytes"
    assert abs(float(total) - exact) <= 1e-7 * exact


def test_fp16_under_fsdp2_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"^train.mixed_precision='fp16' is not supported under train.sharding=fsdp2"):
        TrainSpec(sharding="fsdp2", mixed_precision="fp16")


@pytest.mark.slow
def test_bf16_under_fsdp2_trains_from_fp32_master_weights(tmp_path):
    """bf16 compute over fp32 master weights and fp32 gradient reductions, on 2 gloo ranks: finite, falling loss."""
    kit.train("llava", tmp_path / "run", ["+packing=greedy", "demo.num_samples=32", "data.max_seq_len=512",
                                          f"demo.out_dir={tmp_path / 'demo'}", "train.epochs=3",
                                          "train.micro_batch_size=2", "train.sharding=fsdp2",
                                          "train.mixed_precision=bf16"], nproc=2)
    summary = kit.read_summary(tmp_path / "run")
    assert all(math.isfinite(loss) for loss in summary["losses"]) and summary["loss_last"] < summary["loss_first"]
    assert {w.dtype for w in kit.final_weights(tmp_path / "run").values()} == {torch.float32}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class _TinyLM(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = torch.nn.Embedding(16, 8), torch.nn.ModuleList([_Block(), _Block()]), \
            torch.nn.Linear(8, 16)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(logits=self.head(x))


@pytest.mark.parametrize("grad_sync,calls", [("every", []), ("last", [False, True])])
def test_grad_sync_last_turns_fsdp2_gradient_sync_off_until_a_step_s_last_micro_batch(one_process_group, grad_sync,
                                                                                       calls):
    """``train.grad_sync=last``: FSDP2 keeps the accumulation window's gradients unsharded and reduce-scatters them
    once, after the last micro-batch (``every``: after each). 2 real ranks train the same either way:
    ``tests/test_distributed_matrix.py``."""
    torch.manual_seed(0)
    model = shard_model(_TinyLM(), "no", init_device_mesh("cpu", (1,)))
    seen = []
    original = model.set_requires_gradient_sync
    model.set_requires_gradient_sync = lambda on, **kwargs: seen.append(on) or original(on, **kwargs)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, reduce=lambda t, reduction: t,
                                  backward=lambda loss: loss.backward(), unscale_gradients=lambda: None)
    # the full loss: the tiny model has no output-embeddings accessor for the chunked loss to find its head by
    train = TrainSpec(sharding="fsdp2", grad_sync=grad_sync, gradient_accumulation_steps=2, loss_impl="full")
    step = TrainStep(accelerator, lambda batch, model, attention: {"input_ids": batch["input_ids"]}, "sdpa", {},
                     train, media_kinds=())
    ids = torch.randint(0, 16, (2, 1, 6))
    group = [{"input_ids": row, "labels": row, "pack_segment_ids": torch.zeros_like(row)} for row in ids]
    loss, grad_norm, _ = step(group, model, *optimizer_and_schedule(model, train, 1))
    assert seen == calls and math.isfinite(loss) and grad_norm > 0


def test_offloaded_shards_carry_the_host_policy_and_train_as_shards_on_the_device(one_process_group):
    """``train.offload=params`` hands every unit FSDP2's CPUOffloadPolicy (pinned memory only where CUDA is there);
    one step from the same weights leaves the same weights (2 ranks: tests/test_distributed_matrix.py)."""
    weights = []
    for offload in ("none", "params"):
        torch.manual_seed(0)
        model = shard_model(_TinyLM(), "no", init_device_mesh("cpu", (1,)), offload)
        assert offloaded(model) == (offload == "params")
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        ids = torch.arange(12).reshape(2, 6) % 16
        model(ids).logits.square().mean().backward()
        optimizer.step()
        weights.append([p.full_tensor().detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
def test_an_offloaded_optimizer_steps_as_adamw_and_resumes_through_dcp(one_process_group, sharding):
    """``train.offload=optimizer`` (``HostAdamW``): steps exactly as AdamW on whole parameters and on FSDP2 shards;
    its state is keyed by the model's own parameters and kept beside host copies of them (never the parameters
    themselves); its DCP state dict is AdamW's, and a fresh model and optimizer loaded from it continue as the
    uninterrupted run. (On this CPU host and device are one memory: 2 ranks in tests/test_distributed_matrix.py.)"""
    def build(offload):
        torch.manual_seed(0)
        model = _TinyLM()
        if sharding == "fsdp2":
            model = shard_model(model, "no", init_device_mesh("cpu", (1,)))
        train = TrainSpec(sharding=sharding, offload=offload, learning_rate=0.1, weight_decay=0.01,
                          warmup_ratio=0.0)
        return model, optimizer_and_schedule(model, train, 4)[0]

    def steps(model, optimizer, seeds):
        for seed in seeds:
            ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(seed))
            model(ids).logits.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]

    plain, host = build("none"), build("optimizer")
    assert type(plain[1]) is torch.optim.AdamW and isinstance(host[1], HostAdamW)
    initial = steps(*plain, [])
    trained = steps(*plain, [0, 1])
    assert not any(torch.equal(a, b) for a, b in zip(initial, trained))
    assert all(torch.equal(a, b) for a, b in zip(trained, steps(*host, [0, 1])))
    model, optimizer = host
    trained = [p for p in model.parameters() if p.requires_grad]
    assert list(optimizer.state) == trained and list(optimizer.param_groups[0]["params"]) == trained
    for p in trained:
        assert optimizer.host[p] is not p and set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert isinstance(optimizer.state[p]["exp_avg"], DTensor) == (sharding == "fsdp2")
    saved = {name: get_state_dict(*pair) for name, pair in (("plain", plain), ("host", host))}
    for a, b in zip(tree_leaves(saved["plain"][1]), tree_leaves(saved["host"][1])):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    fresh = build("optimizer")
    set_state_dict(*fresh, model_state_dict=copy.deepcopy(saved["host"][0]),
                   optim_state_dict=copy.deepcopy(saved["host"][1]))
    assert all(not isinstance(v, torch.Tensor) or v.device.type == "cpu"
               for state in fresh[1].state.values() for v in state.values())
    expected = steps(*plain, [2])
    assert all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(expected, steps(*host, [2]), steps(*fresh, [2])))


def test_offload_without_fsdp2_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"^train.offload='params' offloads FSDP2's shards: set "
                                          r"train.sharding=fsdp2$"):
        TrainSpec(offload="params")
