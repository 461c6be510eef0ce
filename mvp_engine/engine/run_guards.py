"""Refusals before a run starts, for runs that could only lose work: one with no optimizer step to take (its epochs
would never end), and one started into a directory that already holds another run (its checkpoints would be
pruned as old, its metrics overwritten, and a later ``resume_from=auto`` would resume the other run).

Both stop with one ``ConfigError`` line saying why and what to do, before any model is built or file written.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import checkpoint_dirs
from .config import ConfigError
from .run_files import METRICS, SUMMARY


def refuse_without_steps(dataset, total_steps: int) -> None:
    """A run whose plan (``total_steps``, as ``estimate_steps`` reads it) has no optimizer step: say which of the
    three ways it got there (nothing drawn, every draw left out, ``drop_last`` leaving out every pack)."""
    if total_steps:
        return
    ledger = dataset.epoch_ledger(epoch=0)
    packs = len(dataset.plan(0).packs)
    if ledger.records_read == 0:
        why = ("the sources draw no record per epoch (every source at repeat: 0 or weight 0, or every source "
               "empty): give data.sources at least one record to draw")
    elif packs == 0:
        reasons = dict((ledger.dropped + ledger.bad).most_common())
        why = (f"all {ledger.records_read} records drawn per epoch are left out ({reasons}): raise data.max_seq_len "
               f"(now {dataset.data_spec.max_seq_len}) or set data.overlong=truncate; the records are listed by "
               "tools/check_data.py")
    else:
        per_step = dataset.world_size * dataset.micro_batch_size
        why = (f"train.drop_last=true leaves out all {packs} packs of an epoch: fewer than world_size x "
               f"micro_batch_size = {dataset.world_size} x {dataset.micro_batch_size} = {per_step}; set "
               "train.drop_last=false or a smaller train.micro_batch_size")
    raise ConfigError(f"the run has 0 optimizer steps: {why}")


def claim_run_dir(output_dir: Path, resume_setting: str | None, resume_from: Path | None) -> None:
    """A directory is owned by one run: a start into one that holds checkpoints, metrics or a summary (Hydra's own
    ``.hydra`` and log files do not count) must resume that run's newest checkpoint (``resume_setting`` is
    ``train.resume_from``; ``resume_from`` the checkpoint it resolved to). ``auto`` over a run killed before its
    first checkpoint starts it over."""
    held = [p.name for p in (output_dir / METRICS, output_dir / SUMMARY) if p.is_file() and p.stat().st_size]
    checkpoints = checkpoint_dirs(output_dir)
    if checkpoints:
        held.append(f"checkpoints up to {checkpoints[-1].name}")
    if not held:
        return
    holds = f"{output_dir} already holds a run ({', '.join(held)})"
    if resume_setting is None:
        raise ConfigError(f"train.output_dir: {holds}: continue it with train.resume_from=auto, or start this run in "
                          "a fresh directory (train.output_dir=... or hydra.run.dir=...)")
    if resume_from is None:  # auto, and no checkpoint to resume
        if SUMMARY in held:
            raise ConfigError(f"train.resume_from=auto: {holds} that finished without a checkpoint to continue "
                              "from: start this run in a fresh directory (train.output_dir=... or hydra.run.dir=...)")
        return
    if not checkpoints or resume_from.resolve() != checkpoints[-1].resolve():
        raise ConfigError(f"train.resume_from: {resume_from} is not the newest checkpoint of the run in "
                          f"train.output_dir ({holds}): its checkpoints would be pruned or resumed by mistake; resume "
                          "the newest (train.resume_from=auto), or resume this checkpoint into a fresh "
                          "train.output_dir")
