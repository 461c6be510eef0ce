"""A recipe's entry point as a user meets it before any training: a refused key or value is one line naming the full
key (and, for a misspelled key, the closest valid ones), that line ends torchrun's failure summary, the run's CPU
threads are set and said, and Hydra writes no empty log. Everything here composes in-process: no run, no launch."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import mvp_engine.engine.testing as kit
from mvp_engine.engine import entry, launch
from mvp_engine.engine.config import CONF_DIR, ConfigError, TrainSpec, _to_object, compose_config

RECIPE = "llava"


def stop_line(monkeypatch, capsys, tmp_path, *overrides: str) -> str:
    """The last stderr line of ``python -m recipes.llava.train <overrides>``, which must stop with status 1."""
    monkeypatch.setattr(sys, "argv", ["train", f"hydra.run.dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(SystemExit) as stopped:
        entry.hydra_main(kit.load_recipe(RECIPE))()
    assert stopped.value.code == 1
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("override,line", [
    ("train.epochs=abc", "train.epochs: 'abc' is not an int"),
    ("train.pad_to_multiple_of=x", "train.pad_to_multiple_of: 'x' is not an int or null"),
    ("train.learnin_rate=1e-3", "train.learnin_rate is not a config key: did you mean train.learning_rate?"),
    ("model.lora.rr=4", "model.lora.rr is not a config key: did you mean model.lora.r?"),
    ("attention=sdpaa", "attention=sdpaa is not an option of attention: allowed auto, eager, flash_attention_2, "
                        "flash_attention_3, flex_attention, sdpa, sdpa_varlen"),
])
def test_a_refused_key_or_value_is_one_line_naming_the_full_key(monkeypatch, capsys, tmp_path, override, line):
    """Hydra used to print 4-5 lines: ``train.epochs=abc`` named ``object_type=TrainSpec``, a misspelled key got
    ``To append to your config use +train.learnin_rate=1e-3`` (which then failed in the spec)."""
    assert stop_line(monkeypatch, capsys, tmp_path, override) == f"config error: {line}"


def test_a_spec_built_from_a_section_names_the_full_key_too():
    """Values that reach a spec past Hydra (a ``+`` key, a library caller's config) once lost the key:
    ``train: Value 'abc' of type 'str' could not be converted to Integer``."""
    for node, line in [({"epochs": "abc"}, "train.epochs: 'abc' is not an int"),
                       ({"learnin_rate": 1.0}, "train.learnin_rate is not a config key: did you mean "
                                               "train.learning_rate?")]:
        with pytest.raises(ConfigError) as err:
            _to_object(OmegaConf.create(node), TrainSpec, "train")
        assert str(err.value) == line


def test_a_group_appended_with_plus_still_composes_and_the_run_sees_hydra_as_the_user_set_it(monkeypatch,
                                                                                            tmp_path):
    seen = {}

    def run_recipe(cfg, recipe):
        seen.update(packing=cfg.packing.strategy, full_error=entry.os.environ.get(entry.HYDRA_FULL_ERROR))

    monkeypatch.setattr(entry, "run_recipe", run_recipe)
    monkeypatch.delenv(entry.HYDRA_FULL_ERROR, raising=False)
    monkeypatch.setattr(sys, "argv", ["train", f"hydra.run.dir={tmp_path}", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none", "+packing=greedy"])
    entry.hydra_main(kit.load_recipe(RECIPE))()
    assert seen == {"packing": "greedy", "full_error": None}
    assert entry.HYDRA_FULL_ERROR not in entry.os.environ


def test_under_torchrun_the_failure_summary_ends_with_the_stop_line(monkeypatch, capsys, tmp_path):
    """torchrun prints its failure summary after every rank's output; each failed rank's entry ended in
    ``traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html``, 40 lines below
    the stop line. The rank writes the line where torchrun reads it (``TORCHELASTIC_ERROR_FILE``)."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    line = stop_line(monkeypatch, capsys, tmp_path, "train.epochs=abc")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    summary = ChildFailedError(f"recipes.{RECIPE}.train", {0: failure}).format_msg().strip().splitlines()
    assert summary[-2].strip() == f"traceback : {line}" and set(summary[-1]) == {"="}
    assert json.loads(error_file.read_text())["message"]["message"] == line


def test_num_threads_auto_is_the_process_share_of_its_cores_and_never_more_than_torch_uses(monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(launch.torch, "get_num_threads", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert launch.threads_for("auto") == 2  # 8 cores, 3 processes here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert launch.threads_for("auto") == 1
    monkeypatch.setattr(launch.torch, "get_num_threads", lambda: 1)  # OMP_NUM_THREADS=1, or a caller's choice
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert launch.threads_for("auto") == 1 and launch.threads_for(5) == 5
    with pytest.raises(ConfigError, match=r"^train.num_threads=0 is invalid: allowed 'auto' or an int >= 1$"):
        TrainSpec(num_threads=0)


def test_a_run_sets_train_num_threads_before_it_builds_anything_and_its_start_line_says_it(monkeypatch):
    seen = []

    class Trainer:
        def __init__(self, cfg, recipe):
            seen.append(torch.get_num_threads())

        def run(self):
            return {}

    monkeypatch.setattr(entry, "Trainer", Trainer)
    cfg = compose_config(RECIPE, ["train.num_threads=1", "data.sources=[unused.jsonl]"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        entry.run_recipe(cfg, kit.load_recipe(RECIPE))
        accelerator = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(value="NO"), device="cpu")
        start = launch.describe_processes(accelerator)
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and start.endswith(", device cpu, torch threads 1")


def test_hydra_writes_no_log_file_into_the_run_directory():
    """The engine prints its lines; Hydra's job logging wrote an always-empty ``train.log`` beside them."""
    for recipe in sorted(path.stem for path in CONF_DIR.glob("*.yaml")):
        handlers = compose_config(recipe).hydra.job_logging.handlers
        assert "file" not in handlers, recipe
