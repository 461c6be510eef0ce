"""The collective-device rule, checked while distributed code runs: every tensor handed to a collective is on the
device its group's backend takes (``collective_device``) and was put there on purpose.

On the CPU's gloo groups the first half passes any tensor made without naming a device, since the CPU is gloo's
device; on a GPU machine the same tensor is a CPU tensor in an NCCL collective, which NCCL refuses. So while the
check runs, tensors a factory (``torch.tensor``, ``torch.zeros``, ...) makes from Python data without a ``device``
are marked, and a marked tensor reaching a collective fails: the CPU test catches what only a GPU would show.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from mvp_engine.packing import sequence_parallel
from mvp_engine.packing.collective_device import collective_device

_UNPLACED = "_made_without_a_device"
# the collectives the project issues (directly or through accelerate), and the functional one of the CP all-to-alls
_DISTRIBUTED = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast", "reduce",
                "reduce_scatter_tensor")


class _MarkUnplaced(TorchFunctionMode):
    """Marks the tensors a factory makes from Python data with no ``device`` (the CPU, whatever the group is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (not torch.compiler.is_compiling() and func in _device_constructors() and kwargs.get("device") is None
                and isinstance(out, torch.Tensor) and not any(isinstance(a, torch.Tensor) for a in args)):
            setattr(out, _UNPLACED, True)
        return out


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _checked(collective, calls: list[str]):
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def call(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        group = arguments.get("group")
        device = collective_device(group)
        where = f"{collective.__name__} on a {dist.get_backend(group)} group"
        for tensor in _tensors(list(arguments.values())):
            assert not getattr(tensor, _UNPLACED, False), \
                f"{where}: a tensor made without a device (on a GPU machine a CPU tensor, which NCCL refuses)"
            assert tensor.device.type == device.type, f"{where} takes {device.type} tensors, got {tensor.device}"
        calls.append(collective.__name__)
        return collective(*args, **kwargs)

    return call


@contextmanager
def collectives_on_their_groups_device() -> Iterator[list[str]]:
    """Inside, every collective checks its tensors (an AssertionError names the collective, its backend and the
    tensor's device); yields the names of the collectives called, in order."""
    calls: list[str] = []
    with ExitStack() as stack:
        for name in _DISTRIBUTED:
            stack.enter_context(mock.patch.object(dist, name, _checked(getattr(dist, name), calls)))
        stack.enter_context(mock.patch.object(sequence_parallel, "all_to_all_single_autograd",
                                              _checked(sequence_parallel.all_to_all_single_autograd, calls)))
        stack.enter_context(_MarkUnplaced())
        yield calls
