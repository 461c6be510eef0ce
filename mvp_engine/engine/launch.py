"""Process-group set-up shared by every run: one accelerator per process, on CUDA or on the CPU.

Launchers (``torchrun``, ``accelerate launch --config_file conf/accelerate/ddp.yaml``) only set environment
variables; the process group comes from accelerate's ``PartialState``. Accelerate picks NCCL when it sees CUDA but,
on a machine without one, falls back to a single process unless it is *told* to use the CPU (``ACCELERATE_USE_CPU``);
asking for the CPU here whenever there is no CUDA makes the same launch command give gloo data parallelism on a CPU
box and NCCL on a GPU box, with no extra environment variable.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

from .config import AUTO_THREADS, AUTO_WORKERS, ConfigError
from .device import cuda_in_use


def fsdp_requested() -> bool:
    """``accelerate launch`` with an FSDP config exports ``ACCELERATE_USE_FSDP=true``."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def build_accelerator(mixed_precision: str, sharding: str = "none", report_to: list[str] | None = None,
                      run_dir: Path | None = None, timeout_s: int | None = None) -> Accelerator:
    """The run's accelerator: CUDA when present (NCCL under a launcher), else the CPU (gloo under a launcher);
    ``VLM_PACKING_DEVICE=cpu`` (``device.py``) asks for the CPU on a machine with CUDA.

    ``sharding`` is ``train.sharding``, the one switch for FSDP2: the engine shards with torch's ``fully_shard``
    itself (``sharding.py``), and the accelerator only sets up the process group and the device. An accelerate
    FSDP config (``conf/accelerate/fsdp2.yaml``) without ``train.sharding=fsdp2`` is refused: accelerate would wrap
    the model in DDP on a CPU machine, so the launch alone must not decide what runs. ``report_to`` is
    ``train.report_to`` (``trackers.py``): TensorBoard writes under ``<run_dir>/tensorboard``. ``timeout_s`` is
    ``train.dist_timeout_s``, how long the process group's collectives wait (None: torch's default, 10 minutes on
    NCCL); the mesh's groups spanning every rank are that group, so FSDP2's broadcast of rank 0's weights waits it.
    """
    if fsdp_requested() and sharding != "fsdp2":
        raise ConfigError(f"train.sharding={sharding!r}, but the accelerate config asks for FSDP (distributed_type: "
                          "FSDP): add train.sharding=fsdp2, or launch with conf/accelerate/ddp.yaml for DDP")
    cuda = cuda_in_use()
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file save/load lines drown the step log
    project = None if run_dir is None else ProjectConfiguration(project_dir=str(run_dir),
                                                                logging_dir=str(run_dir / "tensorboard"))
    handlers = [] if timeout_s is None else [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))]
    return Accelerator(cpu=not cuda, mixed_precision=mixed_precision, log_with=list(report_to or []) or None,
                       project_config=project, kwargs_handlers=handlers)


def use_deterministic(enabled: bool) -> None:
    """``train.deterministic``: torch's deterministic algorithms (an op without one stops the run naming it), the
    fixed cuBLAS workspace torch needs for deterministic CUDA matmuls (set before the first one; a value already in
    the environment is kept) and flash-attn's deterministic backward (transformers reads
    ``FLASH_ATTENTION_DETERMINISTIC`` on every call), so that 2 ranks == 1 rank and an exact resume can be checked
    on a GPU. Off by default: the deterministic kernels are slower. Off leaves the process as it is."""
    if not enabled:
        return
    if cuda_in_use():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    torch.use_deterministic_algorithms(True)


def end_processes() -> None:
    """Tear the process group down before the interpreter does: a gloo group left to interpreter finalisation
    can abort the process (``terminate called without an active exception``) after a run that succeeded. Whatever
    still holds the group (a DDP reducer in a reference cycle) is collected first, while the group is registered,
    so the group is destroyed here and not by a destructor at exit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()


def describe_processes(accelerator: Accelerator) -> str:
    """The line every run prints at start: how many processes really train, over what, on how many CPU threads
    each (a loaded machine's cores shared by too many threads made a CPU run 5-7x slower than one thread)."""
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none (single process)"
    return (f"world_size {accelerator.num_processes}, process-group backend {backend}, "
            f"distributed_type {accelerator.distributed_type.value}, device {accelerator.device}, "
            f"torch threads {torch.get_num_threads()}")


def threads_for(setting: int | str) -> int:
    """``train.num_threads`` as a count. ``auto``: this process's share of the cores it may run on (those cores
    divided by the processes a launcher started on this machine, at least 1), never more than torch already uses:
    ``OMP_NUM_THREADS`` (torchrun sets 1 for several processes) or a caller's ``torch.set_num_threads`` stays."""
    if setting != AUTO_THREADS:
        return int(setting)
    return min(torch.get_num_threads(), max(1, _core_share()))


MAX_AUTO_WORKERS = 4  # a few processes keep a GPU fed; each more holds its own decoded micro-batches in host memory


def workers_for(setting: int | str) -> int:
    """``train.num_workers`` as a count. ``auto``: the cores of this process's share (``threads_for``'s) less the
    one its training thread runs on, at most :data:`MAX_AUTO_WORKERS`, and 0 (decoding on the training thread)
    where the share is one core. Any count gives the same batches in the same order (the loader draws from its
    own seeded generator and the streaming dataset hands out whole micro-batches per worker), so it is chosen for
    speed alone."""
    if setting != AUTO_WORKERS:
        return int(setting)
    return max(0, min(MAX_AUTO_WORKERS, _core_share() - 1))


def _core_share() -> int:
    """The cores this process may run on divided by the processes a launcher started on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def use_threads(setting: int | str) -> None:
    """Run torch's CPU ops on ``threads_for(setting)`` threads; the start line (``describe_processes``) says how
    many."""
    torch.set_num_threads(threads_for(setting))


def report_to_launcher(line: str) -> None:
    """Write the line a rank stops with where torchrun reads a failed rank's error (``TORCHELASTIC_ERROR_FILE``,
    the file its ``@record`` writes): the failure summary torchrun prints last, after every rank's output, then ends
    with this line instead of a link to its docs. Outside torchrun, nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        error = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
        Path(path).write_text(json.dumps(error))
