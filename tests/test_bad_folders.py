"""A bad model or checkpoint folder stops a run with one line naming the folder and what is wrong with it.

Why: transformers and torch read these folders late and piecemeal, so each gap used to end in a 14–92-line
traceback, some with advice about something else: an empty ``model.pretrained`` asked to install sentencepiece, a
folder without ``config.json`` built a full-size default model until memory ran out, another family's folder loaded
with its weights newly initialised, a folder without tokenizer files gave a one-token tokenizer; a damaged or
foreign checkpoint failed inside DCP, unpickling or ``set_state_dict``. The cases here are copies of one tiny saved
model and of one two-step in-process run's checkpoints, each damaged one way, and a LoRA checkpoint written by the
``Checkpointer`` directly; the checks read names, JSON and headers only, so every case takes milliseconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, DCP_METADATA, STATE_FILE, Checkpointer, RunState, checkpoint_dirs
from mvp_engine.engine.checkpoint_folder import check_checkpoint_fits, check_checkpoint_folder
from mvp_engine.engine.config import ConfigError, compose_config, resolve_run_specs
from mvp_engine.engine.lora import lora_spec, save_adapters
from mvp_engine.engine.model_folder import check_model_folder
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.run import assemble
from mvp_engine.engine.run_model import prepare_model

RECIPE = "qwen2_vl"
LORA = "model.lora.r=4"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The recipe's tiny model and processor, saved as a ``model.pretrained`` folder."""
    folder = tmp_path_factory.mktemp("pretrained") / "model"
    recipe, cfg = load_recipe(RECIPE), compose_config(RECIPE)
    recipe.build_model(cfg.model, "sdpa").save_pretrained(folder)
    recipe.build_processor(cfg.model).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return kit.write_mixed_jsonl(tmp_path_factory.mktemp("data"), num_records=5)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data) -> Path:
    """Two steps, a checkpoint after each (the newest damaged per case, the one before it named as the way out)."""
    run_dir = tmp_path_factory.mktemp("run")
    kit.train(RECIPE, run_dir, run_overrides(data))
    return run_dir


def run_overrides(data: Path) -> list[str]:
    return [f"data.sources=[{data}]", "+packing=greedy", "data.max_seq_len=160", "train.epochs=2",
            "train.save_every_steps=1"]


def built_model(recipe: str, *overrides: str):
    """The run's model as the assembly builds it (adapters added, frozen parameters frozen), and whether LoRA is on."""
    cfg = compose_config(recipe, list(overrides))
    specs = resolve_run_specs(cfg, load_recipe(recipe).attention_backends)
    model, _ = prepare_model(load_recipe(recipe), cfg.model, specs.model, "eager", "train")
    return model, specs.model.lora.enabled


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> Path:
    """A LoRA run's files after one step, written as the trainer writes them: the checkpoint (adapters only) and the
    adapter folder ``model``."""
    root = tmp_path_factory.mktemp("lora")
    model, _ = built_model(RECIPE, LORA)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sum(p.sum() for p in model.parameters() if p.requires_grad).backward()
    optimizer.step()
    scheduler.step()
    one_process = SimpleNamespace(is_main_process=True, process_index=0, scaler=None, wait_for_everyone=lambda: None)
    Checkpointer(one_process, root, 1, model, optimizer, scheduler, trainable_only=True).save(RunState(step=1))
    recipe, cfg = load_recipe(RECIPE), compose_config(RECIPE, [LORA])
    save_adapters(lambda: recipe.build_model(cfg.model, "sdpa"), lora_spec(cfg.model), model.state_dict(),
                  root / "model")
    recipe.build_processor(cfg.model).save_pretrained(root / "model")
    return root


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def shard(folder: Path) -> None:
    """The weights as a two-shard index whose second shard is gone."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))


MODEL_CASES = {  # damage -> what the line says is wrong
    "empty": (lambda f: [p.unlink() for p in f.iterdir()], "the folder is empty"),
    "no config.json": (lambda f: (f / "config.json").unlink(), "no config.json"),
    "another family's model": (lambda f: edit_json(f / "config.json", model_type="llava"),
                               "model_type 'llava'; this recipe trains 'qwen2_vl' models"),
    "truncated weights": (lambda f: truncate(f / "model.safetensors"), "model.safetensors is truncated or corrupt"),
    "corrupt weights": (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64),
                        "model.safetensors is truncated or corrupt"),
    "a missing shard": (shard, r"model-00002-of-00002.safetensors is missing \(named in model.safetensors.index"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no weights"),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer file"),
    "no image processor": (lambda f: (f / "preprocessor_config.json").unlink(), "no image-processor file"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_a_bad_model_folder_stops_the_assembly_with_one_line(model_folder, tmp_path, case):
    """Through the assembly every entry point and tool runs (a plan: no data, no accelerator), before the processor
    or the model reads the folder."""
    damage, reason = MODEL_CASES[case]
    folder = copy_of(model_folder, tmp_path)
    damage(folder)
    cfg = compose_config(RECIPE, [f"model.pretrained={folder}"])
    with pytest.raises(ConfigError, match=rf"^model.pretrained={folder}: .*{reason}") as refused:
        assemble(cfg, load_recipe(RECIPE), "plan")
    assert "\n" not in str(refused.value)


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"^model.pretrained={tmp_path / 'nowhere'}: no such folder"):
        check_model_folder(tmp_path / "nowhere", ("qwen2_vl",))


def test_good_model_and_adapter_folders_pass(model_folder, lora):
    recipe = load_recipe(RECIPE)
    check_model_folder(model_folder, recipe.model_types)
    check_model_folder(lora / "model", recipe.model_types)


def newest(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run directory's checkpoints; its newest checkpoint."""
    shutil.copytree(run_dir / CHECKPOINTS, tmp_path / CHECKPOINTS)
    return checkpoint_dirs(tmp_path)[-1]


CHECKPOINT_CASES = {  # damage of the newest checkpoint -> what the line says is wrong
    "deleted .distcp": (lambda c: (c / "__0_0.distcp").unlink(), r"__0_0.distcp is missing"),
    "truncated .distcp": (lambda c: truncate(c / "__0_0.distcp"), r"__0_0.distcp is truncated \(\d+ bytes; "),
    "deleted .metadata": (lambda c: (c / DCP_METADATA).unlink(), r"its \.metadata is missing"),
    "truncated .metadata": (lambda c: truncate(c / DCP_METADATA), r"its \.metadata cannot be read \(Unpickling"),
    "deleted rng": (lambda c: (c / "rng_0.pt").unlink(), r"rng_0.pt is missing \(written by rank 0 of the 1 "),
    "truncated rng": (lambda c: truncate(c / "rng_0.pt"), r"rng_0.pt cannot be read"),
    "corrupt trainer_state.json": (lambda c: truncate(c / STATE_FILE), rf"its {STATE_FILE} cannot be read \(JSON"),
    "deleted trainer_state.json": (lambda c: (c / STATE_FILE).unlink(), rf"its {STATE_FILE} is missing"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_a_damaged_checkpoint_is_named_with_the_one_before_it(run, tmp_path, case):
    damage, reason = CHECKPOINT_CASES[case]
    checkpoint = newest(run, tmp_path)
    damage(checkpoint)
    earlier = checkpoint_dirs(tmp_path)[-2]
    with pytest.raises(ConfigError, match=rf"^train.resume_from: checkpoint {checkpoint} is damaged: {reason}.*: "
                                          rf"resume from {earlier}$"):
        check_checkpoint_folder(checkpoint)


def test_resume_auto_from_a_damaged_checkpoint_stops_the_assembly(run, data, tmp_path):
    """Through the assembly: the checkpoint is checked before the processor, the model or the data are built."""
    truncate(newest(run, tmp_path) / "__0_0.distcp")
    cfg = compose_config(RECIPE, [*run_overrides(data), f"train.output_dir={tmp_path}", "train.resume_from=auto"])
    with pytest.raises(ConfigError, match=r"^train.resume_from: checkpoint .*step_00000002 is damaged: __0_0.distcp "
                                          r"is truncated"):
        assemble(cfg, load_recipe(RECIPE), "train")


def test_intact_checkpoints_pass(run, lora):
    for checkpoint in [*checkpoint_dirs(run), *checkpoint_dirs(lora)]:
        check_checkpoint_folder(checkpoint)


FOREIGN_MODELS = {  # the checkpoint ("run": the whole model, "lora": adapters r=4), the run resuming it -> what differs
    "the same model": ("run", (RECIPE,), None),
    "the same adapters": ("lora", (RECIPE, LORA), None),
    "LoRA on": ("run", (RECIPE, LORA), r"\d+ saved tensors this run does not load \('lm_head.weight', .*\); \d+ "
                                     r"tensors of this run not saved \('.*lora_A.default.weight'"),
    "LoRA off": ("lora", (RECIPE,), r"\d+ saved tensors this run does not load \('.*lora_A.default.weight'"),
    "another LoRA rank": ("lora", (RECIPE, "model.lora.r=8"), r"\d+ tensors of another shape \('.*lora_A.default."
                                                               r"weight' saved \[4, \d+\], here \[8, \d+\]"),
    "another recipe": ("run", ("llava",), r"\d+ saved tensors this run does not load .*; \d+ tensors of this run not "
                                          r"saved \('model.multi_modal_projector"),
}


@pytest.mark.parametrize("case", list(FOREIGN_MODELS))
def test_a_checkpoint_of_another_model_is_refused_before_loading(run, lora, case):
    """Its DCP metadata (names and shapes) against the model as built: before the data set, and before DCP or
    ``set_state_dict`` would fail on it."""
    saved_by, overrides, reason = FOREIGN_MODELS[case]
    checkpoint = checkpoint_dirs({"run": run, "lora": lora}[saved_by])[-1]
    model, trainable_only = built_model(*overrides)
    if reason is None:
        check_checkpoint_fits(checkpoint, model, trainable_only)
        return
    with pytest.raises(ConfigError, match=rf"^train.resume_from: checkpoint {checkpoint} does not fit this run's "
                                          rf"model: .*{reason}.*another recipe, model or model.lora setting"):
        check_checkpoint_fits(checkpoint, model, trainable_only)
