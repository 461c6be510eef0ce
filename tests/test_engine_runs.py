"""Engine behaviour around a run: launching, the schedule, freezing, drop accounting and config validation."""

from __future__ import annotations

import importlib.util
import math
import re
import signal
import subprocess
import sys

import pytest
import torch
from accelerate.commands import launch as accelerate_launch
from transformers import get_scheduler

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, resolve_attention, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.device import cuda_in_use
from mvp_engine.engine.entry import run_recipe
from mvp_engine.engine.testkit.launch import count_launch
from mvp_engine.engine.trainer import Trainer

CONF = kit.CONF_DIR


@pytest.mark.launch
@pytest.mark.parametrize("config,sharding", [("ddp", "none"), ("fsdp2", "fsdp2")])
def test_accelerate_launch_with_a_config_trains_two_processes_in_one_run_directory(config, sharding, tmp_path,
                                                                                   monkeypatch, capfd):
    """``accelerate launch`` with the config, its command line parsed and run by accelerate's own ``main`` in this
    process (the launcher's interpreter cost ~8 s of imports), in the environment and folder the command had: its
    torchrun agent starts the 2 ranks as fresh processes, which write to this process's output."""
    argv = ["--config_file", str(CONF / "accelerate" / f"{config}.yaml"), "--num_processes", "2",
            "--main_process_port", "0", "-m", "recipes.llava.train", "+packing=bfd", "demo.num_samples=24",
            "data.max_seq_len=512", "train.epochs=1", f"train.sharding={sharding}", f"demo.out_dir={tmp_path / 'demo'}"]
    for key, value in kit.LAUNCH_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["accelerate.commands.launch", *argv])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    count_launch("launched")
    try:
        accelerate_launch.main()  # a rank that fails raises (torchrun's ChildFailedError), as the command exits 1
    finally:
        for sig, handler in handlers.items():  # the agent's handlers, set in this process, end with the launch
            signal.signal(sig, handler)
    out = capfd.readouterr().out
    assert "world_size 2, process-group backend gloo" in out
    assert ("sharding: fsdp2 over 2 ranks" in out) == (sharding == "fsdp2"), out
    run_dirs = list((tmp_path / "outputs" / "llava").iterdir())
    assert len(run_dirs) == 1, f"one launch made {run_dirs}"
    summary = kit.read_summary(run_dirs[0])
    assert summary["world_size"] == 2 and summary["steps_per_rank_this_session"] == [summary["estimated_steps"]] * 2
    assert summary["sharding"] == sharding


def stops_with(capsys, line: str) -> bool:
    """The run's last stderr line (what ``run_recipe`` prints before ``SystemExit(1)``) matches ``line``."""
    return re.search(line, capsys.readouterr().err.strip().splitlines()[-1]) is not None


def test_an_fsdp_launch_without_train_sharding_is_refused_with_one_line(monkeypatch, tmp_path, capsys):
    """accelerate would wrap the model in DDP on a CPU machine: the launch alone never decides what runs."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    cfg = kit.compose_config("llava", [f"train.output_dir={tmp_path}", f"demo.out_dir={tmp_path / 'demo'}"])
    with pytest.raises(SystemExit):
        run_recipe(cfg, kit.load_recipe("llava"))
    assert stops_with(capsys, r"^config error: train.sharding='none', but the accelerate config asks for FSDP .*"
                              r"add train.sharding=fsdp2")


def test_every_way_out_of_a_run_tears_the_process_group_down(tmp_path, capsys):
    """A gloo group left to interpreter finalisation can abort a rank after a run that succeeded."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cfg = kit.compose_config("llava", [f"train.output_dir={tmp_path}", "train.seed=-3"])
    with pytest.raises(SystemExit):
        run_recipe(cfg, kit.load_recipe("llava"))
    assert stops_with(capsys, "^config error: train.seed")
    assert not torch.distributed.is_initialized()


@pytest.mark.launch
@pytest.mark.gpu
def test_fsdp2_trains_on_cuda(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONF / "accelerate" / "fsdp2.yaml"),
           "--num_processes", "1", "--main_process_port", "0", "-m", "recipes.qwen2_vl.train", "+packing=greedy",
           "demo.num_samples=24", "train.epochs=1", "train.sharding=fsdp2", f"demo.out_dir={tmp_path / 'demo'}",
           f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=CONF.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = kit.read_summary(tmp_path)
    assert summary["actual_steps"] == summary["estimated_steps"] and summary["sharding"] == "fsdp2"


@pytest.mark.parametrize("override,key", [
    ("train.mixed_precision=bogus", "train.mixed_precision"), ("train.lr_scheduler=zigzag", "train.lr_scheduler"),
    ("train.weight_decay=-1", "train.weight_decay"), ("train.max_grad_norm=0", "train.max_grad_norm"),
    ("train.save_every_steps=-1", "train.save_every_steps"), ("train.keep_last=0", "train.keep_last"),
    ("train.resume_from=/no/such/checkpoint", "train.resume_from"), ("train.pad_to_multiple_of=0",
                                                                     "train.pad_to_multiple_of"),
    ("train.seed=-3", "train.seed"), ("train.num_workers=-1", "train.num_workers"),
    ("train.sharding=zero3", "train.sharding"),
])
def test_every_train_value_is_checked_at_config_time(override, key):
    recipe = kit.load_recipe("qwen2_vl")
    with pytest.raises(ConfigError, match=f"^{key}="):
        resolve_run_specs(kit.compose_config("qwen2_vl", [override]), recipe.attention_backends)


def test_a_freeze_pattern_that_matches_nothing_names_the_key(tmp_path, capsys):
    cfg = kit.compose_config("llava", ["model.freeze=[model.no_such_module]", f"train.output_dir={tmp_path}",
                                       f"demo.out_dir={tmp_path / 'demo'}"])
    with pytest.raises(SystemExit):
        run_recipe(cfg, kit.load_recipe("llava"))
    assert stops_with(capsys, "^config error: model.freeze: pattern 'model.no_such_module' matches no")


def test_llava_stage_one_trains_only_the_projector(tmp_path):
    freeze = "model.freeze=[model.vision_tower,model.language_model,lm_head]"
    cfg = kit.compose_config("llava", ["+packing=greedy", freeze, "demo.num_samples=24", "data.max_seq_len=512",
                                       "train.epochs=2", "train.warmup_ratio=0", f"train.output_dir={tmp_path}",
                                       f"demo.out_dir={tmp_path / 'demo'}"])
    trainer = Trainer(with_demo_data(cfg), kit.load_recipe("llava"))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    summary = trainer.run()
    after = dict(trainer.model.named_parameters())
    projector = {name for name in before if name.startswith("model.multi_modal_projector.")}
    assert projector and summary["parameters"]["trainable"] == sum(before[n].numel() for n in projector)
    for name, value in before.items():
        changed = not torch.equal(value, after[name])
        assert changed == (name in projector), f"{name}: changed={changed}"


def test_the_logged_lr_is_the_rate_each_step_trained_at(tmp_path):
    summary = kit.smoke_run("qwen2_vl", "greedy", tmp_path / "run", ("train.warmup_ratio=0.3",))
    logged = [m["lr"] for m in kit.read_metrics(tmp_path / "run")]
    steps = summary["actual_steps"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-3)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=math.ceil(0.3 * steps), num_training_steps=steps)
    expected = []
    for _ in range(steps):
        expected.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert logged == expected and logged[0] == 0.0


def test_drop_last_drops_are_counted_with_their_reason(tmp_path):
    summary = kit.smoke_run("qwen2_vl", "bfd", tmp_path / "run", ("train.drop_last=true", "train.micro_batch_size=3"))
    dropped = summary["totals"]["dropped"]
    assert dropped.get("drop_last", 0) > 0, dropped
    assert summary["totals"]["samples"] + dropped["drop_last"] == summary["planned"]["samples"]


@pytest.mark.parametrize("recipe", ["qwen2_vl", "llava"])
def test_auto_attention_resolves_per_run_kind_to_a_backend_this_machine_trains_with(recipe):
    loaded = kit.load_recipe(recipe)
    packed = resolve_run_specs(kit.compose_config(recipe, ["attention=auto", "+packing=greedy"]),
                               loaded.attention_backends)
    unpacked = resolve_run_specs(kit.compose_config(recipe, ["attention=auto"]), loaded.attention_backends)
    flash = cuda_in_use() and importlib.util.find_spec("flash_attn") is not None
    assert packed.attention == ("flash_attention_2" if flash else "sdpa_varlen")
    assert unpacked.attention == ("flash_attention_2" if flash else "sdpa")


def test_auto_attention_without_a_trainable_backend_names_the_key():
    with pytest.raises(ConfigError, match="attention.implementation=auto found no backend"):
        resolve_attention("auto", ("flex_attention",), packed=True)
