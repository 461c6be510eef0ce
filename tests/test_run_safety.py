"""Runs that cannot lose a user's work: a run with nothing to train refuses instead of looping, a run directory
belongs to one run, stop signals checkpoint, and the final model appears whole or not at all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, Checkpointer, RunState, checkpoint_dirs, load_run_state
from mvp_engine.engine.preemption import PreemptionWatch
from mvp_engine.engine.run_files import RunFiles
from mvp_engine.engine.trainer import Trainer

RECIPE = "llava"


def base(data: Path) -> list[str]:
    return ["+packing=greedy", f"data.sources=[{data}]", "data.max_seq_len=256", "train.epochs=1",
            "train.save_every_steps=1", "train.keep_last=100", "train.micro_batch_size=1",
            "train.gradient_accumulation_steps=1"]


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def data() -> Path:
    return kit.shared_mixed_jsonl(11)


@pytest.mark.parametrize("overrides,why", [
    (["data.max_seq_len=8"], r"all 11 records drawn per epoch are left out \(\{'overlong': 11\}\): raise "
                             r"data.max_seq_len \(now 8\)"),
    (["train.drop_last=true", "train.micro_batch_size=64"],
     r"train.drop_last=true leaves out all \d+ packs of an epoch: fewer than world_size x micro_batch_size = "
     r"1 x 64 = 64"),
])
def test_a_run_without_an_optimizer_step_refuses_before_it_starts(data, tmp_path, overrides, why):
    """It used to print ``train: 0it`` and spin forever, appending the same drops to dropped_records.jsonl."""
    result = kit.train(RECIPE, tmp_path, [*base(data), *overrides], check=False, timeout=120)
    assert result.returncode == 1
    assert re.search(f"^config error: the run has 0 optimizer steps: {why}", last_line(result)), last_line(result)
    assert not (tmp_path / "dropped_records.jsonl").exists() and not (tmp_path / CHECKPOINTS).exists()


def test_a_mixture_that_draws_nothing_refuses(data, tmp_path):
    mixture = f"data.sources=[{{path: '{data}', repeat: 0}}]"
    result = kit.train(RECIPE, tmp_path, [*base(data), mixture], check=False, timeout=120)
    assert "the run has 0 optimizer steps: the sources draw no record per epoch" in last_line(result), result.stderr


def test_an_epoch_the_loader_ends_early_fails_loudly_instead_of_looping(data, tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_loader", lambda self, epoch, rank_packs_done=0: [])
    result = kit.train(RECIPE, tmp_path, base(data), check=False, timeout=120)
    assert result.returncode == 1
    assert "epoch 0 ended after 0 of its" in result.stderr and "fewer packs than the plan holds" in result.stderr


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> Path:
    """A finished run with a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("finished")
    kit.train(RECIPE, run_dir, base(data))
    return run_dir


def copy_run(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def test_a_start_into_a_directory_that_holds_a_run_refuses(finished, data, tmp_path):
    """keep_last would have deleted the new run's checkpoints (the old run's steps are higher) and a later
    resume_from=auto would have resumed the old run."""
    run_dir = copy_run(finished, tmp_path / "run")
    before = sorted(p.name for p in checkpoint_dirs(run_dir))
    result = kit.train(RECIPE, run_dir, [*base(data), "train.learning_rate=1e-3"], check=False, timeout=120)
    assert re.search(r"^config error: train.output_dir: .* already holds a run \(metrics.jsonl, summary.json, "
                         r"checkpoints up to step_\d{8}\): continue it with train.resume_from=auto",
                         last_line(result)), result.stderr
    assert sorted(p.name for p in checkpoint_dirs(run_dir)) == before


def test_resuming_an_older_checkpoint_in_place_refuses(finished, data, tmp_path):
    run_dir = copy_run(finished, tmp_path / "run")
    older = checkpoint_dirs(run_dir)[0]
    result = kit.train(RECIPE, run_dir, [*base(data), f"train.resume_from={older}"], check=False, timeout=120)
    assert re.search(r"^config error: train.resume_from: .*step_00000001 is not the newest checkpoint",
                         last_line(result)), result.stderr


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path):
    """Even when the directory holds higher step numbers (another run's, copied in): pruning by name alone deleted
    the new checkpoint as soon as it was written."""
    AcceleratorState._reset_state(reset_partial_state=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    (tmp_path / CHECKPOINTS / "step_00000099").mkdir(parents=True)
    checkpointer = Checkpointer(Accelerator(cpu=True), tmp_path, 1, model, optimizer, scheduler)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert checkpointer.save(RunState(step=2)).name == "step_00000002"
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000002"]


def test_a_resumed_run_reports_its_own_throughput(finished, data, tmp_path):
    """Its tokens/s counts this session's tokens only, not the whole run's over this session's seconds."""
    run_dir = copy_run(finished, tmp_path / "run")
    middle = checkpoint_dirs(run_dir)[len(checkpoint_dirs(run_dir)) // 2]
    for later in checkpoint_dirs(run_dir):
        if later.name > middle.name:
            shutil.rmtree(later)
    before = load_run_state(middle).accounting().effective
    kit.train(RECIPE, run_dir, [*base(data), "train.resume_from=auto"])
    summary = kit.read_summary(run_dir)
    session = summary["totals"]["effective"] - before
    assert 0 < session < summary["totals"]["effective"]
    assert summary["effective_tokens_per_s"] == pytest.approx(session / summary["seconds"])


def test_sigint_stops_at_the_next_step_boundary_with_a_checkpoint(data, tmp_path, monkeypatch):
    """Ctrl-C saves like SIGTERM (it used to save nothing); a second Ctrl-C stops at once."""
    step = Trainer._step

    def step_then_ctrl_c(self, session, *args):
        step(self, session, *args)
        if session.progress.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "_step", step_then_ctrl_c)
    result = kit.train(RECIPE, tmp_path, [*base(data), "train.save_every_steps=0"])
    summary = kit.read_summary(tmp_path)
    assert summary["stopped_by"] == "SIGINT" and summary["actual_steps"] == 2, result.stdout
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000002"]
    assert "resume with train.resume_from=auto" in result.stdout


def test_sigint_before_the_first_step_stops_with_one_line(data, tmp_path, monkeypatch):
    """Before the loop's handler is in place (the data still being measured) Ctrl-C ended in a traceback."""
    import mvp_engine.engine.trainer as trainer

    assemble = trainer.assemble

    def assemble_then_ctrl_c(*args, **kwargs):
        run = assemble(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return run

    monkeypatch.setattr(trainer, "assemble", assemble_then_ctrl_c)
    result = kit.train(RECIPE, tmp_path, base(data), check=False, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert last_line(result).startswith("stopped by SIGINT at once (before the first step"), result.stderr


def test_a_second_sigint_interrupts_at_once():
    with PreemptionWatch() as watch:
        os.kill(os.getpid(), signal.SIGINT)
        assert watch.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_the_final_model_appears_whole_or_not_at_all(tmp_path):
    """A kill during the final save used to leave ``model/`` holding only config.json."""
    final = tmp_path / "model"
    final.mkdir()
    (final / "config.json").write_text(json.dumps({"old": True}))
    with pytest.raises(RuntimeError), RunFiles.written_aside(final) as partial:
        (partial / "config.json").write_text("{}")
        raise RuntimeError("killed mid-save")
    assert json.loads((final / "config.json").read_text()) == {"old": True}
    with RunFiles.written_aside(final) as partial:
        (partial / "config.json").write_text(json.dumps({"new": True}))
        (partial / "model.safetensors").write_text("weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert json.loads((final / "config.json").read_text()) == {"new": True}
