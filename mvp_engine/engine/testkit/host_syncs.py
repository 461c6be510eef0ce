"""Counting the host synchronisations a step issues, on the CPU: every call that, on a GPU, makes the host wait for
the device (a value read back: ``item``, ``tolist``, ``bool`` / ``int`` / ``float`` / ``index`` of a tensor, a copy
to the CPU, an equality or a data-dependent shape: ``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``, ``repeat_interleave`` without ``output_size``), each attributed to the code that called it.

Why on the CPU: torch's ``cuda.set_sync_debug_mode`` needs a GPU (``tools/gpu_check.py`` uses it there); a
``TorchFunctionMode`` sees the same calls on any device, so a CPU test can bound them. A call counts whatever its
tensor's device: where metadata really lives on the CPU in the step it is still a call the step makes, and the rule
(``DESIGN.md``, GPU rules) is that packed metadata is computed in the collator, before the step.

Attribution: the innermost frame outside torch and this module decides: the project's own code (``mvp_engine``,
``recipes``, ``tools``) or a library (transformers, accelerate, ...). Calls inside ``torch.optim`` are not counted:
the optimizers keep their step counts on the host unless ``capturable`` (AdamW's ``.item()`` per parameter reads a
CPU tensor on a GPU machine too), so they wait for nothing.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO_ROOT = Path(__file__).resolve().parents[3]
PROJECT_DIRS = tuple(str(REPO_ROOT / name) + "/" for name in ("mvp_engine", "recipes", "tools"))
TORCH_DIR = str(Path(torch.__file__).parent) + "/"
OPTIM_DIR = TORCH_DIR + "optim/"

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.equal,
          torch.Tensor.nonzero, torch.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
          torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive}
_REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


def _syncs(func, args, kwargs) -> bool:
    if func in _READS:
        return True
    if func in _REPEATS:  # a tensor of repeats sizes the output from its values unless output_size says it
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    if func is torch.Tensor.__getitem__:  # a boolean mask selects a data-dependent number of elements
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


@dataclass
class HostSyncs:
    """The calls counted, by ``(where, op)``: ``where`` the calling ``file:line`` and whether it is the project's."""

    project: Counter = field(default_factory=Counter)
    library: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.project.values()) + sum(self.library.values())

    @property
    def from_project(self) -> int:
        return sum(self.project.values())

    def describe(self, top: int = 12) -> str:
        lines = [f"{self.total} host syncs, {self.from_project} from the project's code"]
        lines += [f"  project {n:4d}  {where}" for where, n in self.project.most_common(top)]
        lines += [f"  library {n:4d}  {where}" for where, n in self.library.most_common(top)]
        return "\n".join(lines)


def _caller() -> tuple[str, bool] | None:
    """The calling ``file:line function`` and whether it is the project's; None inside ``torch.optim``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(OPTIM_DIR):
            return None
        if not (name.startswith(TORCH_DIR) or name == __file__):
            return f"{name.replace(str(REPO_ROOT) + '/', '')}:{frame.f_lineno} {frame.f_code.co_name}", \
                name.startswith(PROJECT_DIRS)
        frame = frame.f_back
    return "?", False


class _Count(TorchFunctionMode):
    def __init__(self, counts: HostSyncs):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = _caller() if _syncs(func, args, kwargs) and not torch.compiler.is_compiling() else None
        if caller is not None:
            where, ours = caller
            (self.counts.project if ours else self.counts.library)[f"{where} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)


@contextmanager
def counting_host_syncs() -> Iterator[HostSyncs]:
    """Inside, every synchronising call of this thread is counted into the yielded ``HostSyncs``."""
    counts = HostSyncs()
    with _Count(counts):
        yield counts
