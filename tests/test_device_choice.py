"""The suite on a GPU machine: CPU tests stay on the CPU, GPU-only cases are marked ``gpu`` and run on CUDA. No GPU is
needed to check the choice: CUDA is faked (``torch.cuda.is_available``) and the selection functions are asked."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mvp_engine.engine.launch as launch
import mvp_engine.engine.testkit as kit
import mvp_engine.engine.testkit.recompute as recompute
import mvp_engine.engine.testkit.runs as runs
from mvp_engine.engine.config import ConfigError, backward_available, check_attention
from mvp_engine.engine.device import DEVICE_ENV, cuda_in_use
from mvp_engine.engine.testkit.equivalence import LOW_PRECISION_TOL
from mvp_engine.engine.testkit.launch import LAUNCH_ENV
from mvp_engine.engine.testkit.suites import EquivalenceSuite

BACKENDS = ("sdpa", "sdpa_varlen", "flex_attention", "flash_attention_2")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"


@pytest.fixture
def cuda_machine(monkeypatch):
    """This process looks like a machine with 2 GPUs and flash_attn installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "flash_attn" else find_spec(name, *args))


def test_cuda_is_used_where_present_unless_the_cpu_is_asked_for(cuda_machine, monkeypatch):
    monkeypatch.delenv(DEVICE_ENV)
    assert cuda_in_use()
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert not cuda_in_use()
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ConfigError, match=f"^{DEVICE_ENV}='gpu' is invalid: allowed one of"):
        cuda_in_use()


def test_a_test_not_marked_gpu_runs_as_on_a_cpu_machine(cuda_machine):
    """``conftest.py`` asks every unmarked test's runs for the CPU."""
    assert os.environ[DEVICE_ENV] == "cpu" and not cuda_in_use()


@pytest.mark.parametrize("choice,cpu", [(None, False), ("cpu", True)])
def test_the_accelerator_takes_the_cpu_when_asked_on_a_cuda_machine(cuda_machine, monkeypatch, choice, cpu):
    """gloo ranks on a GPU machine: two NCCL ranks would share one GPU, which NCCL refuses."""
    if choice is None:
        monkeypatch.delenv(DEVICE_ENV)
    built = {}
    monkeypatch.setattr(launch, "Accelerator", lambda **kwargs: built.update(kwargs))
    launch.build_accelerator("no")
    assert built["cpu"] is cpu


def test_a_cpu_run_on_a_cuda_machine_takes_no_cuda_only_backend(cuda_machine, monkeypatch):
    for backend in ("flex_attention", "flash_attention_2"):
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            check_attention(backend, BACKENDS)
    monkeypatch.delenv(DEVICE_ENV)
    for backend in ("flex_attention", "flash_attention_2"):
        check_attention(backend, BACKENDS)


def test_backward_is_available_where_the_model_sits_not_where_the_machine_has_cuda(cuda_machine):
    assert not backward_available("flex_attention", "cpu")
    assert backward_available("flex_attention", "cuda") and backward_available("sdpa", "cpu")


def test_every_training_the_testkit_starts_runs_on_the_cpu(cuda_machine, monkeypatch):
    """Launched and pooled ranks take ``LAUNCH_ENV`` at start; an in-process run (``runs._call``) sets it for its
    call only."""
    assert LAUNCH_ENV[DEVICE_ENV] == "cpu"
    monkeypatch.delenv(DEVICE_ENV)
    with runs._as_launched():
        assert not cuda_in_use()
    assert DEVICE_ENV not in os.environ


class _Metafunc:
    def __init__(self, test):
        self.function, self.fixturenames, self.params = test, ["case", "backend"], None

    def parametrize(self, name, values):
        self.params = values


@pytest.mark.parametrize("test,on_gpu", [
    (EquivalenceSuite.test_packed_equals_one_by_one, ["flash_attention_2"]),
    (EquivalenceSuite.test_activation_checkpointing_is_exact_and_recomputes, ["flex_attention", "flash_attention_2"]),
])
def test_cases_that_need_cuda_are_marked_gpu(monkeypatch, test, on_gpu):
    """flex runs forward on the CPU but trains only on CUDA; flash needs CUDA for either."""
    monkeypatch.setattr(kit, "load_recipe", lambda name: SimpleNamespace(attention_backends=BACKENDS))
    metafunc = _Metafunc(test)
    EquivalenceSuite.pytest_generate_tests(EquivalenceSuite(), metafunc)
    marked = [p.values[0] for p in metafunc.params if any(m.name == "gpu" for m in getattr(p, "marks", ()))]
    assert marked == on_gpu and [getattr(p, "values", (p,))[0] for p in metafunc.params] == list(BACKENDS)


@pytest.mark.parametrize("backend,device,dtype,tol", [
    ("sdpa", "cpu", torch.float32, recompute.RECOMPUTE_TOL),
    ("flex_attention", "cuda", torch.float32, recompute.RECOMPUTE_TOL),
    ("flash_attention_2", "cuda", torch.bfloat16, LOW_PRECISION_TOL),
])
def test_the_recompute_check_runs_where_its_backend_trains(monkeypatch, backend, device, dtype, tol):
    seen = []

    def packed_backward(case, backend, checkpointing, device, dtype):
        seen.append((checkpointing, device, dtype))

    monkeypatch.setattr(recompute, "packed_backward", packed_backward)
    report = recompute.run_recompute_check(SimpleNamespace(recipe=SimpleNamespace(name="r")), backend)
    assert seen == [(False, device, dtype), (True, device, dtype)] and report.tol == tol


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tool = _gpu_check()
    assert tool.main([]) == 0
    assert capsys.readouterr().out.strip() == tool.NO_GPU


def test_gpu_check_probes_every_family_it_claims_on_each_backend():
    """Every recipe folder is a family the check claims, and each has a bf16 packed probe per backend and an fp32
    one per sdpa backend."""
    tool = _gpu_check()
    recipes = {p.parent.name for p in (TOOL.parents[1] / "recipes").glob("*/train.py")}
    assert set(tool.FAMILIES) == recipes and {"llava", "qwen2_vl", "gemma3"} <= recipes
    names = [p.name for p in tool.probes()]
    assert len(names) == len(set(names))
    expected = ([f"packed:{f}:{b}" for f in tool.FAMILIES for b in tool.BF16_BACKENDS]
                + [f"packed-fp32:{f}:{b}" for f in tool.FAMILIES for b in tool.FP32_BACKENDS])
    assert set(expected) <= set(names)
    assert {"flash_attention_2", "sdpa_varlen", "flex_attention"} == set(tool.BF16_BACKENDS)
    assert {"cp2", "fsdp2-2ranks", "flex-recompiles:gemma3", "host-syncs:qwen2_vl", "train:qwen2_vl"} <= set(names)
