"""Every collective takes tensors on its process group's device: the device a backend takes, and the check that
fails a tensor off it or made without a device (on a GPU machine a CPU tensor, which NCCL refuses). The check runs
over the CP ranks of every recipe's ``ContextParallelSuite`` (``testkit/context_parallel.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mvp_engine.engine.testkit.collectives import collectives_on_their_groups_device
from mvp_engine.packing.collective_device import collective_device


@pytest.mark.parametrize("backend, device", [("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cuda"),
                                             ("xccl", "xpu"), ("mpi", "cpu")])
def test_the_device_a_groups_backend_takes(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert collective_device() == torch.device(device)


def test_the_check_fails_a_tensor_off_its_groups_device_or_made_without_one(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with collectives_on_their_groups_device():
        with pytest.raises(AssertionError, match="all_reduce on a nccl group takes cuda tensors, got cpu"):
            dist.all_reduce(torch.ones(1, device="cpu"))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with collectives_on_their_groups_device():
        with pytest.raises(AssertionError, match="all_gather on a gloo group: a tensor made without a device"):
            dist.all_gather([torch.zeros((), device="cpu")], torch.tensor(3))
