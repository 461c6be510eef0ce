"""How batches reach the step: ``train.num_workers=auto`` loader processes from this process's share of the cores,
pinned memory and non-blocking host-to-device copies on CUDA only. Any worker count gives the same batches in the
same order (``tests/test_resume.py`` resumes under another count and logs the same metrics), so ``auto`` is about
speed alone; the test kit's trainings pin 0 (``testkit.launch.KIT_OVERRIDES``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mvp_engine.engine import launch, train_step
from mvp_engine.engine.config import ConfigError, TrainSpec
from mvp_engine.engine.trainer import Trainer


@pytest.mark.parametrize("cores,local_world,workers", [(2, 1, 1), (1, 1, 0), (2, 2, 0), (8, 2, 3), (64, 1, 4),
                                                        (64, 8, 4), (4, 8, 0)])
def test_num_workers_auto_is_the_process_share_of_its_cores_less_its_own_at_most_four(monkeypatch, cores,
                                                                                        local_world, workers):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert TrainSpec().num_workers == "auto"
    assert launch.workers_for("auto") == workers and launch.workers_for(3) == 3 and launch.workers_for(0) == 0


@pytest.mark.parametrize("value", [-1, "many", True, 1.5])
def test_a_num_workers_that_is_neither_auto_nor_a_count_is_refused_with_one_line(value):
    with pytest.raises(ConfigError, match=rf"^train.num_workers={value!r} is invalid: allowed 'auto' or an int >= 0$"):
        TrainSpec(num_workers=value)


class _Dataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([index])

    def set_epoch(self, epoch):
        pass

    def starting_at(self, packs_done):
        return self


@pytest.mark.parametrize("device,pinned", [("cuda", True), ("cpu", False)])
def test_the_run_loader_pins_its_batches_on_cuda_only_and_resolves_auto_workers(monkeypatch, device, pinned):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    trainer = SimpleNamespace(dataset=_Dataset(), collator=None, specs=SimpleNamespace(train=TrainSpec()),
                              accelerator=SimpleNamespace(device=torch.device(device)))
    loader = Trainer._loader(trainer, epoch=0)
    assert (loader.pin_memory, loader.num_workers) == (pinned, 4)


def test_batches_go_to_cuda_without_blocking_and_elsewhere_as_before(monkeypatch):
    calls = []
    monkeypatch.setattr(train_step, "send_to_device", lambda batch, device, **kwargs: calls.append(kwargs) or batch)
    for device in ("cuda", "cpu"):
        train_step.batch_to_device({"input_ids": torch.ones(1, 2)}, torch.device(device))
    assert calls == [{"non_blocking": True}, {"non_blocking": False}]
