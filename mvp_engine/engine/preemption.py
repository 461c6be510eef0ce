"""Preemption: SIGTERM (what SLURM and Kubernetes send before a kill) ends the run at the next step boundary.

The handler only sets a flag, so no step or collective is interrupted half-way. At each step boundary the ranks
sum their flags in one tiny all-reduce: a signal that reached a single rank stops them all at the same step, and no
rank is left waiting in a collective the others have abandoned. The trainer then saves a checkpoint and returns,
so the process exits 0 well inside torchrun's 30 s grace period.
"""

from __future__ import annotations

import signal

import torch
from accelerate import Accelerator

STOP_SIGNALS = (signal.SIGTERM,)


class PreemptionWatch:
    """Context manager: installs the flagging handler, restores the previous one on exit."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> PreemptionWatch:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed_stop(self) -> bool:
        """True on every rank when any rank has received a stop signal (a collective: call it on all ranks)."""
        flag = torch.tensor([0.0 if self.received is None else 1.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a SIGTERM sent to the whole process group must reach the trainer's handler,
    not kill its workers mid-batch (they end with their parent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
