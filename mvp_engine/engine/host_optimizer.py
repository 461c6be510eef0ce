"""``train.offload=optimizer``: AdamW whose state and update live in host memory while the parameters and their
gradients stay on the device (DeepSpeed's ZeRO-Offload split).

Why: fp32 AdamW keeps two moments per trained parameter, 8 of the 16 bytes a parameter costs on the device; moving
them to the host frees that much device memory at the price of copying each gradient to the host and each updated
parameter back once per optimizer step. ``train.offload=params`` (FSDP2's ``CPUOffloadPolicy``) moves more, the
parameters and gradients too, and copies every unit in for each forward and backward.

Why not an existing one: torchao's ``CPUOffloadOptimizer`` is for single-GPU training (it asserts a CUDA or XPU
device and copies on a side stream from pinned buffers, so it cannot run on the CPU where the project is tested),
builds one optimizer per parameter over host copies with a state dict of its own (DCP's resume by parameter name
could not map it), and is not among this project's packages; torch 2.13 has none. So, minimally: :class:`HostAdamW`
is torch's ``AdamW`` over the model's own parameters (its state dict, the DCP helpers and every resume see the
model's parameters as any optimizer's), with one host copy of each parameter (a ``DTensor`` shard stays a shard, on
the host) that receives the parameter and its gradient before each step; torch's AdamW steps those copies, creating
and keeping its state beside them on the host, and the updated values are copied back into the device parameters.
Loading a state dict goes through the host copies too, so a resume never puts the state on the device. The copies
are plain blocking ones: nothing overlaps the update with the next forward (ZeRO-Offload's one-step delay and pinned
buffers are left out).

On a CPU-only machine host and device are the same memory: the copies run and the arithmetic is torch's AdamW on
the same values, so a run trains exactly what it trains without offload (tests/test_distributed_matrix.py); what
it saves is only measurable on a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new host tensor holding ``tensor``'s values; a ``DTensor`` becomes the same shard of the same global
    tensor with its local part on the host (as FSDP2's offloaded shards are)."""
    local = _local(tensor).detach().to(HOST, copy=True)
    if isinstance(tensor, DTensor):
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return local


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its state and its update on the host (see the module docstring)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.host: dict[torch.Tensor, torch.Tensor] = {}  # each parameter's host copy, made at its first step

    @contextmanager
    def _on_host(self) -> Iterator[None]:
        """Inside, the parameter groups hold the host copies and the state is keyed by them, as if the optimizer
        had been built over the copies; outside, both name the model's parameters again."""
        params = [group["params"] for group in self.param_groups]
        for p in (p for group in params for p in group):
            if p not in self.host:
                self.host[p] = host_copy(p)
        copies = {p: self.host[p] for group in params for p in group}
        self.state = defaultdict(dict, {copies.get(p, p): value for p, value in self.state.items()})
        for group, members in zip(self.param_groups, params):
            group["params"] = [copies[p] for p in members]
        try:
            yield
        finally:
            originals = {id(copy): p for p, copy in copies.items()}
            self.state = defaultdict(dict, {originals.get(id(key), key): value for key, value in self.state.items()})
            for group, members in zip(self.param_groups, params):
                group["params"] = members

    @torch.no_grad()
    def step(self, closure=None):
        """Each parameter with a gradient and that gradient to its host copy, torch's AdamW step there, the
        updated copy back into the parameter."""
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure: the loss is computed on the device before the step")
        stepped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    if p in self.host:
                        self.host[p].grad = None
                    continue
                stepped.append(p)
        with self._on_host():
            for p in stepped:
                copy = self.host[p]
                _local(copy).copy_(_local(p))
                if copy.grad is None:
                    copy.grad = host_copy(p.grad)
                else:
                    _local(copy.grad).copy_(_local(p.grad))
            super().step()
        for p in stepped:
            _local(p).copy_(_local(self.host[p]))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading with the host copies standing for the parameters: it casts each state tensor to its
        parameter's device, here the host's, so the state never lands on the device."""
        with self._on_host():
            super().load_state_dict(state_dict)
