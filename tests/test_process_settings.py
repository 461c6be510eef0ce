"""What a run sets up for its processes before anything is built: the process group's timeout
(``train.dist_timeout_s``) and deterministic kernels (``train.deterministic``).

Why the timeout: under FSDP2 from a pretrained folder rank 0 alone reads the weights while the other ranks wait at
its broadcast; torch's NCCL default (10 minutes) is shorter than reading a large model. Checked on the arguments the
accelerator is built with (a real one would set up this process's accelerate state for the rest of the session).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

import mvp_engine.engine.launch as launch
import mvp_engine.engine.run as run
import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import resolve_run_specs

RECIPE = "llava"


@pytest.fixture
def accelerator_arguments(monkeypatch) -> list[dict]:
    """Every Accelerator's keyword arguments; none is built."""
    built = []
    monkeypatch.setattr(launch, "Accelerator", lambda **kwargs: built.append(kwargs))
    return built


@pytest.fixture
def process_state(monkeypatch):
    """The deterministic switches a run sets, put back after the test."""
    for name in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def test_the_run_waits_dist_timeout_s_and_switches_deterministic_kernels_on(accelerator_arguments, process_state,
                                                                              tmp_path):
    held = kit.write_mixed_jsonl(tmp_path / "held", num_records=3)
    cfg = kit.compose_config(RECIPE, [f"data.eval_sources=[{held}]", "train.dist_timeout_s=3600",
                                      "train.deterministic=true"])
    run._start(resolve_run_specs(cfg, kit.load_recipe(RECIPE).attention_backends), training=False)
    (handler,) = accelerator_arguments[0]["kwargs_handlers"]
    assert handler.timeout == timedelta(seconds=3600)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"


def test_deterministic_on_cuda_fixes_the_cublas_workspace_and_off_touches_nothing(process_state, monkeypatch):
    monkeypatch.setattr(launch, "cuda_in_use", lambda: True)
    launch.use_deterministic(False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    launch.use_deterministic(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()


def test_the_default_timeout_outlasts_torchs_nccl_default(accelerator_arguments):
    launch.build_accelerator("no", timeout_s=kit.compose_config(RECIPE).train.dist_timeout_s)
    (handler,) = accelerator_arguments[0]["kwargs_handlers"]
    assert handler.timeout >= timedelta(minutes=30)


def _mesh_group_timeouts(rank: int, timeout_s: int | None) -> dict[str, float]:
    """On a pooled rank of 2: the world's group waits 77 s; the timeout of each group the run's (DP, CP) mesh uses,
    with CP = 2 (DP groups of one rank each: groups the mesh makes itself)."""
    import torch.distributed as dist

    from mvp_engine.engine.parallel import CP, DP, WORLD, build_layout

    dist.init_process_group("gloo", timeout=timedelta(seconds=77))
    try:
        accelerator = type("Accelerator", (), {"num_processes": 2, "process_index": rank,
                                               "device": torch.device("cpu")})()
        mesh = build_layout(accelerator, 2, packed=True, timeout_s=timeout_s).mesh
        return {name: mesh[name].get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name in (DP, CP, WORLD)}
    finally:
        dist.destroy_process_group()


@pytest.mark.launch
def test_the_mesh_groups_wait_dist_timeout_s_too():
    """``train.dist_timeout_s`` reaches the groups the device mesh makes for a dim that does not span the world (DP
    here), which torch would otherwise create with its default (30 minutes on gloo, 10 on NCCL); a dim spanning the
    world reuses the world's group and its timeout."""
    from mvp_engine.engine.testkit.runs import run_on_ranks

    for timeouts in run_on_ranks(2, _mesh_group_timeouts, 77):
        assert timeouts == {"dp": 77, "cp": 77, "dp_cp": 77}
    for timeouts in run_on_ranks(2, _mesh_group_timeouts, None):  # without it: torch's default on the DP groups
        assert timeouts["dp"] == 1800 and timeouts["cp"] == 77
