"""Checkpoints a run can resume from bit-exactly, written so that a crash mid-save never costs the previous one.

Model and optimizer go through ``torch.distributed.checkpoint`` (DCP): ``get_state_dict`` / ``set_state_dict``
give the same canonical names for a plain, a DDP and an FSDP2-sharded model, and ``FileSystemWriter`` writes a
``.metadata`` file plus one ``__<rank>_<n>.distcp`` per rank holding that rank's shards (under DDP every tensor is
replicated and DCP writes it once). This one path replaces accelerate's ``save_state`` / ``load_state`` for every
kind of run: the engine shards with ``fully_shard`` itself (``sharding.py``), which accelerate's ``save_state`` does
not know, and DCP reshards on load, so a checkpoint resumes under another world size, sharded or not.

Beside the DCP files: the scheduler and fp16's loss scaler (inside the DCP state, written once), every rank's RNG states
(``rng_<rank>.pt``: python, numpy, torch, CUDA) and :class:`RunState` in ``trainer_state.json``: step, epoch,
optimizer steps done in that epoch, the accounting totals and the losses so far. The position is counted by the
trainer itself, in optimizer steps, never read back from the dataset (DataLoader workers keep their own copies);
a stream (``data.streaming``), which no step count can replay, adds its state (``RunState.data``: cursors, the
buffered records' keys, RNG states), handed to the trainer with the batch that ends each step.
Packs are assigned to steps before ranks (``dataset.py``), so a step count means the same packs under any split of
the same global batch: :meth:`RunState.check_resume` allows another world size when the global batch is unchanged.
A rank that did not exist in the checkpoint takes rank 0's RNG states, which is what every rank starts from in a
fresh run (``set_seed`` seeds all ranks alike); the data order never draws from them (the loader has its own
seeded generator).

Atomicity: every rank writes into ``checkpoints/.step_XXXXXXXX.partial``; once all have finished, the main process
renames it to ``checkpoints/step_XXXXXXXX`` and only then deletes checkpoints beyond ``keep_last``. A directory
without the ``.partial`` prefix is therefore always complete; one damaged since, or saved from another model, is
refused in one line before a run is built on it (``checkpoint_folder.py``).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from mvp_engine.kit.mllm.data import TokenAccounting

from .config import ConfigError
from .expert_parallel import checkpoint_keys, renamed_experts

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
DCP_METADATA = ".metadata"
RNG_FILE = "rng_{rank}.pt"  # each rank's RNG states, beside the DCP files
_COMPLETE = re.compile(r"^step_(\d{8})$")


@dataclass
class RunState:
    """Where a run is and what it has counted; ``epoch``/``epoch_steps_done`` always point at the next step."""

    step: int = 0
    epoch: int = 0
    epoch_steps_done: int = 0  # optimizer steps of ``epoch`` already trained: the same packs under any split
    losses: list[float] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    epochs: list[dict] = field(default_factory=list)  # per-epoch record ledger (EpochLedger.as_dict)
    sources: dict = field(default_factory=dict)  # per-source tallies by name (SourceTally.to_dict)
    # the run shape it was saved under: a resume must keep the global batch (world_size x micro x accumulation)
    world_size: int = 1
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    # what the run is (run_identity.py): a resume by another run refuses; None in checkpoints written before it
    identity: dict | None = None
    # the dataset's own state where a step count does not say where the data is: a stream's cursors, buffered
    # records' keys and RNG states after the last step (data.streaming, kit stream.py); None for indexed data
    data: dict | None = None

    def accounting(self) -> TokenAccounting:
        counts = {k: v for k, v in self.totals.items() if k in TokenAccounting._counts()}
        return TokenAccounting(**counts, dropped=Counter(self.dropped))

    def record(self, loss: float, totals: TokenAccounting) -> None:
        self.step += 1
        self.losses.append(loss)
        self.totals = {name: getattr(totals, name) for name in TokenAccounting._counts()}
        self.dropped = dict(totals.dropped)

    def advance(self, epoch_steps: int) -> None:
        """Move past one optimizer step; the end of an epoch of ``epoch_steps`` points at the start of the next."""
        self.epoch_steps_done += 1
        if self.epoch_steps_done >= epoch_steps:
            self.epoch += 1
            self.epoch_steps_done = 0

    def check_resume(self, world_size: int, micro_batch_size: int, gradient_accumulation_steps: int,
                     drop_last: bool, source: Path) -> None:
        """Another split of the same global batch trains the same packs in the same steps; another global batch,
        or ``drop_last`` (which drops per rank: what is left out depends on world_size x micro_batch_size), would
        continue on other packs than the run would have: refuse."""
        saved = (self.world_size, self.micro_batch_size, self.gradient_accumulation_steps)
        now = (world_size, micro_batch_size, gradient_accumulation_steps)
        if np.prod(saved) != np.prod(now):
            raise ConfigError(
                f"train.resume_from: {source} was saved with a global batch of {np.prod(saved)} packs (world_size="
                f"{saved[0]} x micro_batch_size={saved[1]} x gradient_accumulation_steps={saved[2]}); this run has "
                f"{np.prod(now)} ({now[0]} x {now[1]} x {now[2]}): resume with the same global batch")
        if drop_last and saved[0] * saved[1] != now[0] * now[1]:
            raise ConfigError(
                f"train.resume_from: {source} was saved with world_size x micro_batch_size = {saved[0]} x {saved[1]}"
                f"; this run has {now[0]} x {now[1]}, and train.drop_last=true leaves out other packs under another "
                "product: keep world_size x micro_batch_size, or resume with train.drop_last=false")


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
        path = found[-1] if found else None
    else:
        path = Path(resume_from)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"train.resume_from={resume_from!r} is not a complete checkpoint (no {STATE_FILE}); "
                              f"complete ones are {CHECKPOINTS}/step_XXXXXXXX directories of a run")
    return path


def load_run_state(checkpoint: Path) -> RunState:
    return RunState(**json.loads((checkpoint / STATE_FILE).read_text()))


def _rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


@contextmanager
def _one_process_is_meant():
    """DCP warns on every save and load of a run without a process group (one process): that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def state_dict_options(trainable_only: bool) -> StateDictOptions:
    """What a checkpoint holds of the model: everything, or with ``trainable_only`` (LoRA) the trainable tensors, the
    frozen base being rebuilt from the config as it was on the first start."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


class Checkpointer:
    """Saves and loads the run's model, optimizer, scheduler, RNG and :class:`RunState`, atomically."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, keep_last: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler, trainable_only: bool = False):
        self.accelerator = accelerator
        self.options = state_dict_options(trainable_only)
        self.root = run_dir / CHECKPOINTS
        self.keep_last = keep_last
        self.model = model
        # DCP's state-dict helpers step the optimizer itself (to create empty state): accelerate's wrapper would
        # skip that step inside an accumulation window
        self.optimizer = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        self.scheduler = scheduler

    def _state(self) -> dict:
        model, optimizer = get_state_dict(self.model, self.optimizer, options=self.options)
        state = {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        if self.accelerator.scaler is not None:  # fp16's loss scale
            state["scaler"] = self.accelerator.scaler.state_dict()
        return renamed_experts(state, checkpoint_keys(self.model))  # experts split over ranks: a key per slice

    def save(self, state: RunState) -> Path | None:
        """The checkpoint of ``state``; none before the first step: a fresh start resumes that exactly, while DCP
        would first give the empty optimizer a zero-gradient step to have state to save, which a resume would count."""
        if state.step == 0:
            return None
        name = f"step_{state.step:08d}"
        final, partial = self.root / name, self.root / f".{name}.partial"
        main, rank = self.accelerator.is_main_process, self.accelerator.process_index
        if main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
            partial.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with _one_process_is_meant():
            dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(partial))
        torch.save(_rng_states(), partial / RNG_FILE.format(rank=rank))
        if main:
            (partial / STATE_FILE).write_text(json.dumps(asdict(state)))
        self.accelerator.wait_for_everyone()  # every rank's files are written before the rename publishes them
        if main:
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            # the one just written is always kept, whatever step numbers the directory holds besides it
            others = [path for path in checkpoint_dirs(self.root.parent) if path != final]
            for old in others[:max(0, len(others) - (self.keep_last - 1))]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final

    def load(self, checkpoint: Path) -> RunState:
        """Reshards into this run's layout (any world size, sharded or not); RNG as the module docstring says."""
        loaded = self._state()
        with _one_process_is_meant():
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(checkpoint))
        loaded = renamed_experts(loaded, {v: k for k, v in checkpoint_keys(self.model).items()})
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"], options=self.options)
        self.scheduler.load_state_dict(loaded["scheduler"])
        if "scaler" in loaded:
            self.accelerator.scaler.load_state_dict(loaded["scaler"])
        own = checkpoint / RNG_FILE.format(rank=self.accelerator.process_index)
        _set_rng_states(torch.load(own if own.is_file() else checkpoint / RNG_FILE.format(rank=0), weights_only=False))
        return load_run_state(checkpoint)
