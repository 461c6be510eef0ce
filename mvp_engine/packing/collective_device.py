"""The device a process group's collectives take their tensors on.

A backend serves one device type: NCCL refuses CPU tensors (``No backend type associated with device type cpu``),
gloo is the CPU's. A tensor made for a collective without naming its device lands on the CPU, which a gloo test
never notices and the first NCCL run does; so every tensor the project builds for a collective is placed with
:func:`collective_device` of the group it goes to. accelerate's own collectives (``accelerator.reduce`` /
``gather``) run on its default group, whose device is ``accelerator.device`` by construction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# backends that take accelerator tensors; the others (gloo, mpi, ucc) take CPU tensors
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device type ``group``'s backend takes (None: the default group): ``cuda`` for NCCL, ``cpu`` for gloo.

    A group with one backend per device (``cpu:gloo,cuda:nccl``) takes either; the accelerator's, where the
    model's tensors are, is returned. No index: ``torch.device("cuda")`` is the current device, the one accelerate
    (or the launcher) set for this rank."""
    kinds = []
    for part in str(dist.get_backend(group)).split(","):
        kind, _, backend = part.rpartition(":")
        kinds.append(kind or _ACCELERATOR_BACKENDS.get(backend, "cpu"))
    return torch.device(next((kind for kind in kinds if kind != "cpu"), "cpu"))
