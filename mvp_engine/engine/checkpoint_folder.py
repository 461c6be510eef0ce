"""The checkpoint a run resumes from (``train.resume_from``), checked before the run is built on it: one line naming
the checkpoint and what is wrong with it.

Why: ``Checkpointer.load`` reads a checkpoint once the whole run is built, and a damaged or foreign one then failed
inside torch, 14-43 lines of traceback per rank (measured): a deleted or truncated ``.distcp`` as DCP's
``CheckpointException`` around a file or zip-archive error, a truncated ``.metadata`` as an ``AssertionError``, a
truncated ``rng_<rank>.pt`` as ``OSError: Invalid argument``, another recipe's checkpoint as "Missing key in
checkpoint state_dict", a corrupt ``trainer_state.json`` as a ``JSONDecodeError``; a deleted ``.metadata`` was taken
for an accelerate-format checkpoint. The checks read the JSON, the DCP metadata (names, shapes, the byte range of
every stored item) and the few kilobytes of RNG states; no tensor.

:func:`check_checkpoint_folder` needs only the folder (run before anything is built); :func:`check_checkpoint_fits`
compares the metadata with the run's model as built (before the data set is).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .checkpoint import (
    DCP_METADATA,
    RNG_FILE,
    STATE_FILE,
    RunState,
    checkpoint_dirs,
    load_run_state,
    state_dict_options,
)
from .config import ConfigError
from .expert_parallel import whole_experts

MODEL_PREFIX = "model."  # the model's tensors in the flattened checkpoint state (Checkpointer._state's "model")
EXAMPLES = 2  # names quoted per kind of mismatch


def check_checkpoint_folder(checkpoint: Path) -> None:
    """``checkpoint``'s files are there and readable: ``.metadata``, every byte range it places in the ``.distcp``
    files, ``trainer_state.json`` and the RNG states of every rank that saved it (a rank's own file, not rank 0's,
    is what an exact resume of that rank needs)."""
    if not (checkpoint / DCP_METADATA).is_file():
        if not any(checkpoint.glob("*.distcp")):
            raise ConfigError(f"train.resume_from: {checkpoint} has no {DCP_METADATA}: it was written by "
                              "accelerate's save_state, before checkpoints moved to torch.distributed.checkpoint; "
                              "resume it with the version that wrote it")
        raise _damaged(checkpoint, f"its {DCP_METADATA} is missing")
    metadata = _metadata(checkpoint)
    ends: dict[str, int] = {}
    for item in metadata.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = checkpoint / name
        if not file.is_file():
            raise _damaged(checkpoint, f"{name} is missing")
        if file.stat().st_size < end:
            raise _damaged(checkpoint, f"{name} is truncated ({file.stat().st_size} bytes; {DCP_METADATA} places "
                                       f"data up to byte {end})")
    state = _run_state(checkpoint)
    for rank in range(state.world_size):
        name = RNG_FILE.format(rank=rank)
        if not (checkpoint / name).is_file():
            raise _damaged(checkpoint, f"{name} is missing (written by rank {rank} of the {state.world_size} that "
                                       "saved it)")
        try:
            torch.load(checkpoint / name, weights_only=False)
        except Exception as err:  # a damaged torch.save archive fails in as many ways as there are damages
            raise _damaged(checkpoint, f"{name} cannot be read ({_reason(err)})") from None


def check_checkpoint_fits(checkpoint: Path, model: torch.nn.Module, trainable_only: bool) -> None:
    """``checkpoint`` holds exactly the tensors :class:`~.checkpoint.Checkpointer` would load into ``model`` (the
    run's model before ``parallelize``: the same canonical names), each of the same shape; else one line saying how
    it differs: another recipe, model, or ``model.lora`` setting (on / off, rank, targets)."""
    expected = get_model_state_dict(model, options=state_dict_options(trainable_only))
    saved = whole_experts({key.removeprefix(MODEL_PREFIX): item  # experts split over ranks: as one (expert_parallel)
                           for key, item in _metadata(checkpoint).state_dict_metadata.items()
                           if key.startswith(MODEL_PREFIX)})
    foreign = sorted(saved.keys() - expected.keys())
    absent = sorted(expected.keys() - saved.keys())
    shapes = {name: (list(saved[name].size), list(expected[name].shape)) for name in saved.keys() & expected.keys()
              if isinstance(saved[name], TensorStorageMetadata)}
    reshaped = sorted((name, was, now) for name, (was, now) in shapes.items() if was != now)
    if not (foreign or absent or reshaped):
        return
    found = []
    if foreign:
        found.append(f"{len(foreign)} saved tensors this run does not load ({_names(foreign)})")
    if absent:
        found.append(f"{len(absent)} tensors of this run not saved ({_names(absent)})")
    if reshaped:
        found.append(f"{len(reshaped)} tensors of another shape ("
                     + ", ".join(f"{name!r} saved {was}, here {now}" for name, was, now in reshaped[:EXAMPLES]) + ")")
    raise ConfigError(f"train.resume_from: checkpoint {checkpoint} does not fit this run's model: {'; '.join(found)}: "
                      "it was saved by another recipe, model or model.lora setting (on / off, r, target_modules)")


def _metadata(checkpoint: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(checkpoint).read_metadata()
    except Exception as err:  # unpickling a damaged file fails in as many ways as there are damages
        raise _damaged(checkpoint, f"its {DCP_METADATA} cannot be read ({_reason(err)})") from None


def _run_state(checkpoint: Path) -> RunState:
    if not (checkpoint / STATE_FILE).is_file():
        raise _damaged(checkpoint, f"its {STATE_FILE} is missing")
    try:
        return load_run_state(checkpoint)
    except (ValueError, TypeError) as err:  # not JSON, or not the fields of a RunState
        raise _damaged(checkpoint, f"its {STATE_FILE} cannot be read ({_reason(err)})") from None


def _damaged(checkpoint: Path, what: str) -> ConfigError:
    """The error for a damaged ``checkpoint``, naming the run's previous complete checkpoint when there is one."""
    earlier = [p for p in checkpoint_dirs(checkpoint.parent.parent) if p.name < checkpoint.name]
    instead = f"resume from {earlier[-1]}" if earlier else "no earlier checkpoint of the run is left to resume from"
    return ConfigError(f"train.resume_from: checkpoint {checkpoint} is damaged: {what}: {instead}")


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:EXAMPLES]) + (", ..." if len(names) > EXAMPLES else "")


def _reason(err: BaseException) -> str:
    """The error's type and the first line of its message (torch's can run to many)."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
