"""Preemption: SIGTERM (what SLURM and Kubernetes send before a kill) and SIGINT (Ctrl-C) end the run at the next
step boundary, with a checkpoint; a second SIGINT stops at once (``KeyboardInterrupt``), as a user pressing Ctrl-C
twice expects.

The handler only sets a flag, so no step or collective is interrupted half-way. At each step boundary the ranks
sum their flags in one tiny all-reduce (the trainer's, which carries its other stop reasons too): a signal that
reached a single rank stops them all at the same step, and no rank is left waiting in a collective the others have
abandoned. The trainer then saves a checkpoint and returns,
so the process exits 0 well inside torchrun's 30 s grace period.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    """Context manager: installs the flagging handler, restores the previous one on exit."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> PreemptionWatch:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        """This rank got a stop signal; the trainer sums this flag over ranks at each step boundary."""
        return self.received is not None

    @property
    def reason(self) -> str | None:
        """The name of the signal this rank received (None: none)."""
        return signal.Signals(self.received).name if self.requested else None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a SIGTERM sent to the whole process group must reach the trainer's handler,
    not kill its workers mid-batch (they end with their parent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
