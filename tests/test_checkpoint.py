"""``Checkpointer`` in one process, without a launch: what a DCP checkpoint restores and what it refuses.

Why: the launches of ``tests/test_resume.py`` and ``tests/test_elastic.py`` show whole runs agree; these pin the
pieces that a run's metrics would hide or only show by chance: the optimizer's and the scheduler's exact state, the
RNG a rank the checkpoint did not have takes, no checkpoint before the first step, and an accelerate-format
directory refused with one line.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mvp_engine.engine.checkpoint import CHECKPOINTS, Checkpointer, RunState, resolve_resume
from mvp_engine.engine.checkpoint_folder import check_checkpoint_folder
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.host_optimizer import HostAdamW


def accelerator(rank: int = 0) -> SimpleNamespace:
    """What the checkpointer asks of accelerate, for one process that calls itself ``rank``."""
    return SimpleNamespace(is_main_process=rank == 0, process_index=rank, scaler=None,
                           wait_for_everyone=lambda: None)


def training(seed: int, adamw=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = adamw(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(3, 4)).square().mean()  # draws from the global RNG, as dropout would
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("adamw", [torch.optim.AdamW, HostAdamW])  # HostAdamW: train.offload=optimizer
def test_a_checkpoint_restores_the_rest_of_the_run_exactly(tmp_path, adamw):
    reference = training(0, adamw)
    train(*reference, 3)
    Checkpointer(accelerator(), tmp_path, 2, *reference).save(RunState(step=3))
    expected = train(*reference, 3)
    resumed = training(1, adamw)  # other weights, an optimizer without state
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    state = Checkpointer(accelerator(), tmp_path, 2, *resumed).load(tmp_path / CHECKPOINTS / "step_00000003")
    assert state.step == 3
    assert train(*resumed, 3) == expected
    assert resumed[2].get_last_lr() == reference[2].get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(resumed[0].state_dict().values(), reference[0].state_dict().values()))


def test_a_rank_the_checkpoint_did_not_have_takes_rank_0s_rng(tmp_path):
    run = training(0)
    torch.manual_seed(11)
    Checkpointer(accelerator(), tmp_path, 2, *run).save(RunState(step=1))
    expected = torch.rand(3)
    torch.manual_seed(12)
    Checkpointer(accelerator(rank=3), tmp_path, 2, *training(0)).load(tmp_path / CHECKPOINTS / "step_00000001")
    assert torch.equal(torch.rand(3), expected)


def test_nothing_is_saved_before_the_first_step(tmp_path):
    """At step 0 DCP would give the optimizer a zero-gradient step to have state to save: AdamW would count it."""
    model, optimizer, scheduler = training(0)
    assert Checkpointer(accelerator(), tmp_path, 2, model, optimizer, scheduler).save(RunState()) is None
    assert not (tmp_path / CHECKPOINTS).exists() and not optimizer.state


def test_a_checkpoint_without_dcp_metadata_is_refused_with_one_line(tmp_path):
    old = tmp_path / CHECKPOINTS / "step_00000004"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"has no \.metadata: it was written by accelerate's save_state"):
        check_checkpoint_folder(resolve_resume("auto", tmp_path))
