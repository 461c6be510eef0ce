"""Whether a run trains on CUDA: when CUDA is present, unless ``VLM_PACKING_DEVICE=cpu`` asks for the CPU.

Why a switch: the test suite's trainings (in-process, pooled ranks, launched processes) make CPU claims (2 ranks ==
1 rank x accumulation 2 within 1e-5, bit-exact resume, ``process-group backend gloo``), and on a GPU machine two
pooled ranks would become two NCCL ranks on one GPU, which NCCL refuses. The testkit sets the variable for every
training it starts (``testkit.launch.LAUNCH_ENV``) and the suite for every test not marked ``gpu``. Every engine
decision that depends on CUDA (the accelerator's device, the backends a run may pick) asks here, so a run told to use
the CPU never picks a CUDA-only backend on a machine that has one.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "VLM_PACKING_DEVICE"
DEVICE_CHOICES = ("auto", "cpu")  # auto (or unset): CUDA when present


def cuda_in_use() -> bool:
    """True when this process trains on CUDA: CUDA is present and ``VLM_PACKING_DEVICE`` is not ``cpu``."""
    choice = os.environ.get(DEVICE_ENV, "auto").strip().lower() or "auto"
    if choice not in DEVICE_CHOICES:
        from .config import ConfigError  # here: config.py asks this module, so it cannot be imported at the top

        raise ConfigError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r} is invalid: allowed one of {list(DEVICE_CHOICES)}")
    return choice == "auto" and torch.cuda.is_available()
