"""The ``${run_stamp:FMT}`` resolver of the run directory: one time stamp per launch, shared by every rank."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

import torch
from omegaconf import OmegaConf

RUN_STAMP_KEY = "vlm_packing/run_stamp"


def run_stamp(fmt: str = "%Y-%m-%d_%H-%M-%S") -> str:
    """A time stamp for the run directory that every rank of one launch agrees on.

    Hydra makes the run directory before any application code runs, so ``${now:...}`` would be read once per rank
    and could straddle a second. Under torchrun (and ``accelerate launch``, which uses it) the elastic agent's
    key-value store is reachable at ``MASTER_ADDR:MASTER_PORT``: the first rank to ask writes its stamp there and
    every other rank reads that one back. Elastic restarts of the same launch keep the stamp, so they write into the
    same directory and ``train.resume_from=auto`` finds their checkpoints.
    """
    stamp = datetime.now().strftime(fmt)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return stamp
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=60))
    agreed = store.compare_set(f"{RUN_STAMP_KEY}/{fmt}", "", stamp)
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)


if not OmegaConf.has_resolver("run_stamp"):
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)
