"""Checkpoints a run can resume from bit-exactly, written so that a crash mid-save never costs the previous one.

Model, optimizer, the registered scheduler and every rank's RNG states (python, numpy, torch) go through
accelerate's ``save_state`` / ``load_state``. What accelerate does not know, the trainer's position, is
:class:`RunState` in ``trainer_state.json`` beside them: step, epoch, micro-batches consumed in that epoch, the
accounting totals and the losses so far. The position is counted by the trainer itself, never read back from the
dataset (DataLoader workers keep their own copies), so it is right for map-style and streaming datasets and for any
``num_workers``.

Atomicity: every rank writes into ``checkpoints/.step_XXXXXXXX.partial``; once all have finished, the main process
renames it to ``checkpoints/step_XXXXXXXX`` and only then deletes checkpoints beyond ``keep_last`` (accelerate's own
``total_limit`` deletes before writing). A directory without the ``.partial`` prefix is therefore always complete.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator

from mvp_engine.kit.mllm.data import TokenAccounting

from .config import ConfigError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_COMPLETE = re.compile(r"^step_(\d{8})$")


@dataclass
class RunState:
    """Where a run is and what it has counted; ``epoch``/``micro_batches_done`` always point at the next step."""

    step: int = 0
    epoch: int = 0
    micro_batches_done: int = 0
    losses: list[float] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    epochs: list[dict] = field(default_factory=list)  # per-epoch record ledger (EpochLedger.as_dict)
    # the run shape a resume must match: a different split of the data would silently train other packs
    world_size: int = 1
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1

    def accounting(self) -> TokenAccounting:
        counts = {k: v for k, v in self.totals.items() if k in TokenAccounting._counts()}
        return TokenAccounting(**counts, dropped=Counter(self.dropped))

    def record(self, loss: float, totals: TokenAccounting) -> None:
        self.step += 1
        self.losses.append(loss)
        self.totals = {name: getattr(totals, name) for name in TokenAccounting._counts()}
        self.dropped = dict(totals.dropped)

    def advance(self, micro_batches: int, epoch_micro_batches: int) -> None:
        """Move past ``micro_batches``; the end of an epoch points at the start of the next."""
        self.micro_batches_done += micro_batches
        if self.micro_batches_done >= epoch_micro_batches:
            self.epoch += 1
            self.micro_batches_done = 0

    def check_shape(self, world_size: int, micro_batch_size: int, gradient_accumulation_steps: int,
                    source: Path) -> None:
        """Resuming under another data split would continue on other packs than the run would have: refuse."""
        saved = (self.world_size, self.micro_batch_size, self.gradient_accumulation_steps)
        now = (world_size, micro_batch_size, gradient_accumulation_steps)
        if saved != now:
            raise ConfigError(
                f"train.resume_from: {source} was saved with world_size={saved[0]}, micro_batch_size={saved[1]}, "
                f"gradient_accumulation_steps={saved[2]}; this run has {now[0]}, {now[1]}, {now[2]}; resume with "
                "the same shape (the data split per rank and per step depends on it)")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run directory, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _COMPLETE.match(p.name)), key=lambda p: p.name)


def resolve_resume(resume_from: str | None, run_dir: Path) -> Path | None:
    """``auto``: the newest complete checkpoint of ``run_dir`` (None when there is none yet: a fresh start);
    a path: that checkpoint, which must be complete."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found = checkpoint_dirs(run_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"train.resume_from={resume_from!r} is not a complete checkpoint (no {STATE_FILE}); "
                          f"complete ones are {CHECKPOINTS}/step_XXXXXXXX directories of a run")
    return path


def load_run_state(checkpoint: Path) -> RunState:
    return RunState(**json.loads((checkpoint / STATE_FILE).read_text()))


class Checkpointer:
    """Saves and loads the accelerator's registered state plus :class:`RunState`, atomically."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, keep_last: int):
        self.accelerator = accelerator
        self.root = run_dir / CHECKPOINTS
        self.keep_last = keep_last

    def save(self, state: RunState) -> Path:
        name = f"step_{state.step:08d}"
        final, partial = self.root / name, self.root / f".{name}.partial"
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
            partial.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(partial))
        if main:
            (partial / STATE_FILE).write_text(json.dumps(asdict(state)))
        self.accelerator.wait_for_everyone()  # every rank's files are written before the rename publishes them
        if main:
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            for old in checkpoint_dirs(self.root.parent)[:-self.keep_last]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final

    def load(self, checkpoint: Path) -> RunState:
        self.accelerator.load_state(str(checkpoint))
        return load_run_state(checkpoint)
