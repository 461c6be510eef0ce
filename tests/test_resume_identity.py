"""A checkpoint resumes only the run that wrote it (``mvp_engine/engine/run_identity.py``).

The refusals are checked on composed configs and a written ``trainer_state.json``, without training; one short
in-process run proves that the trainer records its identity, that the entry point refuses a changed run in one line
before building anything, and that the elastic changes still resume.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, STATE_FILE, RunState, checkpoint_dirs, load_run_state
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.run_identity import check_identity, run_identity, setting_defaults

RECIPE = "qwen2_vl"


def overrides(data: Path, *more: str) -> list[str]:
    return ["+packing=greedy", f"data.sources=[{data}]", "data.max_seq_len=96", "train.epochs=1",
            "train.micro_batch_size=2", "train.learning_rate=5e-4", *more]


def identity(data: Path, *more: str) -> dict:
    cfg = kit.compose_config(RECIPE, overrides(data, *more))
    return run_identity(RECIPE, resolve_run_specs(cfg, kit.load_recipe(RECIPE).attention_backends))


def checkpoint(directory: Path, saved: dict | None) -> Path:
    """A checkpoint's ``trainer_state.json`` as the trainer writes it (the rest of a checkpoint is not read here)."""
    path = directory / CHECKPOINTS / "step_00000002"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps(asdict(RunState(step=2, identity=saved))))
    return path


def refusal(path: Path, current: dict) -> str:
    with pytest.raises(ConfigError) as refused:
        check_identity(load_run_state(path).identity, current, path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"train.resume_from: {path} was saved by another run: ")
    assert line.endswith("or start a fresh run in another train.output_dir")
    return line


@pytest.fixture
def data(tmp_path) -> Path:
    return kit.write_mixed_jsonl(tmp_path / "data", num_records=6)


def test_a_changed_learning_rate_or_epochs_is_refused_naming_every_change(data, tmp_path):
    saved = checkpoint(tmp_path, identity(data))
    line = refusal(saved, identity(data, "train.learning_rate=1e-3", "train.epochs=2", "train.lr_scheduler=linear"))
    assert "train.learning_rate 0.0005 -> 0.001" in line and 'train.lr_scheduler "cosine" -> "linear"' in line
    assert "train.epochs 1 -> 2 (the lr schedule spans the run's total steps" in line


def test_records_appended_to_a_source_or_another_data_set_is_refused(data, tmp_path):
    saved = checkpoint(tmp_path, identity(data))
    other = kit.write_mixed_jsonl(tmp_path / "other", num_records=6)
    assert f"data source 'mixed' is another file: {data} -> {other}" in refusal(saved, identity(other))
    with data.open("a") as handle:
        handle.write(data.read_text().splitlines()[0] + "\n")
    assert "data source 'mixed' changed (records appended or rewritten)" in refusal(saved, identity(data))


def test_data_staged_again_as_a_faithful_copy_still_resumes(data, tmp_path):
    """``rsync -a`` / ``cp -p`` onto the same path keeps size, mtime and bytes but not ctime: the length cache measures
    again (it cannot risk a stale length), while the run is the same run and resumes."""
    before = identity(data)
    copy = tmp_path / "staged.jsonl"
    shutil.copy2(data, copy)
    shutil.copy2(copy, data)
    assert identity(data) == before


def test_the_mixture_and_the_plan_settings_are_part_of_the_run(data, tmp_path):
    saved = checkpoint(tmp_path, identity(data))
    line = refusal(saved, identity(data, f"data.sources=[{{path:{data},repeat:2}}]", "packing.strategy=bfd",
                                   "data.max_seq_len=128", "model.lora.r=4"))
    assert "data source 'mixed' repeat 1.0 -> 2.0" in line and 'packing.strategy "greedy" -> "bfd"' in line
    assert "data.max_seq_len 96 -> 128" in line and "model.lora.r 0 -> 4" in line


def test_elastic_changes_keep_the_identity(data, tmp_path):
    saved = checkpoint(tmp_path, identity(data))
    elastic = identity(data, "train.num_workers=2", "train.keep_last=1", "train.save_every_steps=3",
                       "train.log_every=1", "train.eval_every_steps=5", "train.micro_batch_size=1",
                       "train.gradient_accumulation_steps=2", f"train.output_dir={tmp_path / 'elsewhere'}",
                       "data.measure_workers=1", "data.cache_dir=" + str(tmp_path / "cache"),
                       "train.dist_timeout_s=60", "train.deterministic=true")
    assert check_identity(load_run_state(saved).identity, elastic, saved) is None


def test_a_setting_newer_than_the_checkpoint_counts_only_when_set_away_from_its_default(data, tmp_path):
    """A version that adds a setting must still resume the checkpoints of the version before it."""
    older = {key: value for key, value in identity(data).items() if key != "data.max_record_bytes"}
    saved = checkpoint(tmp_path, older)
    cfg = kit.compose_config(RECIPE, overrides(data))
    defaults = setting_defaults(resolve_run_specs(cfg, kit.load_recipe(RECIPE).attention_backends))
    assert check_identity(load_run_state(saved).identity, identity(data), saved, defaults) is None
    line = refusal(saved, identity(data, "data.max_record_bytes=1024"))
    assert "data.max_record_bytes unset -> 1024" in line


def test_a_checkpoint_from_before_identities_resumes_with_a_warning(data, tmp_path):
    saved = checkpoint(tmp_path, None)
    assert load_run_state(saved).identity is None
    warning = check_identity(load_run_state(saved).identity, identity(data), saved)
    assert warning.startswith(f"warning: train.resume_from: {saved} was saved before checkpoints recorded their run")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """One short run (5 steps, a checkpoint after each) over its own data set."""
    data = kit.write_mixed_jsonl(tmp_path_factory.mktemp("identity_data"), num_records=5)
    run = tmp_path_factory.mktemp("identity_run")
    kit.train(RECIPE, run, overrides(data, "train.micro_batch_size=1", "train.keep_last=10",
                                     "train.save_every_steps=1"))
    return data, run


def test_a_run_records_its_identity_and_refuses_a_changed_resume_in_one_line(reference, tmp_path):
    data, run = reference
    first = run / CHECKPOINTS / "step_00000001"
    assert load_run_state(first).identity == json.loads(json.dumps(identity(data, "train.micro_batch_size=1")))
    result = kit.train(RECIPE, tmp_path, overrides(data, "train.micro_batch_size=1", "train.learning_rate=1e-3",
                                                   f"train.resume_from={first}"), check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"config error: train.resume_from: {first} was saved by another run: train.learning_rate 0.0005 -> 0.001: "
        "restore the settings and data it was saved with, or start a fresh run in another train.output_dir")
    assert not (tmp_path / CHECKPOINTS).exists()


def test_an_elastic_resume_of_a_checkpoint_from_before_identities_warns_once_and_continues(reference, tmp_path):
    """A checkpoint without an identity resumes (under another split and loader, which are elastic anyway) with one
    warning, trains the rest of the run exactly, and its next checkpoint records the identity."""
    data, run = reference
    old = tmp_path / "old"
    shutil.copytree(run / CHECKPOINTS / "step_00000002", old)
    state = json.loads((old / STATE_FILE).read_text())
    del state["identity"]
    (old / STATE_FILE).write_text(json.dumps(state))
    resumed = tmp_path / "resumed"
    result = kit.train(RECIPE, resumed, overrides(data, "train.micro_batch_size=1", "train.num_workers=1",
                                                  "train.keep_last=1", "train.save_every_steps=1",
                                                  f"train.resume_from={old}"))
    assert result.stdout.count("was saved before checkpoints recorded their run") == 1
    assert kit.read_metrics(resumed) == kit.read_metrics(run)[2:]
    last = checkpoint_dirs(resumed)[-1]
    assert load_run_state(last).identity == load_run_state(run / CHECKPOINTS / last.name).identity is not None
