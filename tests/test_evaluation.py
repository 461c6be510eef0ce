"""Evaluation on ``data.eval_sources``: inside a run (``train.eval_every_steps`` and the end), after a resume, and
stand-alone (``recipes.<name>.evaluate``); the eval loss is the token-weighted mean over the whole eval set, so
packed and unpacked evaluations of one model agree whatever the packing, micro-batch and world size. Stand-alone
scores a saved model only (a LoRA run's adapter folder included, offline), and nothing evaluated is never a loss of
0. Trackers: ``train.report_to=[tensorboard]`` event files read back equal ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import mvp_engine.engine.evaluate as evaluate_module
import mvp_engine.engine.testing as kit
from mvp_engine.engine import trackers
from mvp_engine.engine.checkpoint import CHECKPOINTS
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.entry import run_recipe
from mvp_engine.engine.evaluate import EVAL_FILE, evaluate, evaluate_recipe
from mvp_engine.engine.evaluation import EVAL_LOSS, NO_LOSS, describe, eval_metrics
from mvp_engine.engine.testkit.records import write_messy_jsonl
from mvp_engine.engine.testkit.runs import evaluate_job, run_on_ranks
from mvp_engine.kit.mllm.data import TooManyBadRecords

RECIPE = "llava"
COVERS = ("eval", "resume", "FSDP2")  # on RECIPE, for the coverage table (testkit.coverage)
EVAL_TOL = 1e-5
EVERY = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A training file and two eval files of their own (7 and 5 records, images and text only)."""
    root = tmp_path_factory.mktemp("eval_data")
    train = kit.write_mixed_jsonl(root / "train", num_records=15)
    sources = {}
    for name, count in (("held_a", 7), ("held_b", 5)):
        written = kit.write_mixed_jsonl(root / name, num_records=count)
        sources[name] = written.rename(written.with_name(f"{name}.jsonl"))
    return {"train": train, **sources}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The recipe's tiny model and processor, untrained, saved as a folder: what the evaluations that test the data
    side evaluate (``evaluate`` scores a saved model only)."""
    folder = tmp_path_factory.mktemp("eval_saved")
    recipe, cfg = kit.load_recipe(RECIPE), kit.compose_config(RECIPE)
    recipe.build_model(cfg.model, "sdpa").save_pretrained(folder)
    recipe.build_processor(cfg.model).save_pretrained(folder)
    return folder


def eval_sources(data) -> str:
    """A path (named after its stem) and a mapping naming its source."""
    return f"data.eval_sources=[{data['held_a']},{{path:{data['held_b']},name:val_b}}]"


def run_overrides(data, out: Path, *extra: str) -> list[str]:
    return [f"data.sources=[{data['train']}]", eval_sources(data), f"train.output_dir={out}", "data.max_seq_len=160",
            "+packing=greedy", "train.epochs=2", "train.micro_batch_size=1", "train.learning_rate=5e-3",
            f"train.eval_every_steps={EVERY}", "train.keep_last=100", *extra]


def train(overrides: list[str]) -> dict:
    return run_recipe(kit.compose_config(RECIPE, overrides), kit.load_recipe(RECIPE))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """An uninterrupted run evaluating every 3 steps, with a checkpoint after every step and TensorBoard."""
    out = tmp_path_factory.mktemp("eval_reference")
    train(run_overrides(data, out, "train.save_every_steps=1", "train.report_to=[tensorboard]"))
    return out


def eval_lines(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "eval_loss" in m]


def test_a_run_evaluates_every_n_steps_and_at_its_end(reference, data):
    metrics, summary = kit.read_metrics(reference), kit.read_summary(reference)
    steps = summary["actual_steps"]
    assert steps % EVERY, "the last step is not an eval step: the end adds one"
    evals = eval_lines(metrics)
    assert [m["step"] for m in evals] == [*range(EVERY, steps + 1, EVERY), steps]
    for line in evals:
        assert line["eval_samples"] == 12 and line["eval_tokens"] > 0
        assert set(line) >= {"eval_loss/held_a", "eval_loss/val_b"}
        # the overall loss is the token-weighted mean of the two sources' losses: between them
        assert min(line["eval_loss/held_a"], line["eval_loss/val_b"]) <= line["eval_loss"] <= \
            max(line["eval_loss/held_a"], line["eval_loss/val_b"])
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"], "training lowers the held-out loss"
    final = summary["eval"]
    assert {k: final[k] for k in evals[-1]} == evals[-1]
    assert final["records"] == {name: {"records_read": n, "dropped": {}, "bad": {}, "truncated": 0,
                                       "reconciles": True, "samples_evaluated": n}
                                for name, n in (("held_a", 7), ("val_b", 5))}


def test_evaluating_leaves_the_training_unchanged(reference, data, tmp_path):
    """The eval loader has its own generator and the model evaluates in eval mode: the train lines of a run
    without eval sources are the reference's train lines, exactly."""
    overrides = [o for o in run_overrides(data, tmp_path) if not o.startswith("data.eval_sources")]
    train(overrides)
    trained = [m for m in kit.read_metrics(reference) if "eval_loss" not in m]
    assert kit.read_metrics(tmp_path) == trained
    assert "eval" not in kit.read_summary(tmp_path)


@pytest.mark.parametrize("at", ["an eval step", "between eval steps"])
def test_a_resumed_run_evaluates_where_the_uninterrupted_one_did(reference, data, tmp_path, at):
    """From a checkpoint taken after an evaluation (the evaluation comes first) and from one between two."""
    step = 2 * EVERY if at == "an eval step" else 2 * EVERY + 1
    checkpoint = reference / CHECKPOINTS / f"step_{step:08d}"
    train(run_overrides(data, tmp_path, f"train.resume_from={checkpoint}"))
    expected = [m for m in kit.read_metrics(reference) if m["step"] > step]
    assert kit.read_metrics(tmp_path) == expected
    assert kit.read_summary(tmp_path)["eval"] == kit.read_summary(reference)["eval"]


def test_tensorboard_event_files_hold_what_metrics_jsonl_holds(reference, data):
    runs = list((reference / "tensorboard").iterdir())
    assert [run.name for run in runs] == [RECIPE]
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    metrics = json.loads("[" + ",".join((reference / "metrics.jsonl").read_text().splitlines()) + "]")
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in metrics:
        for key, value in trackers.scalars(line).items():
            expected.setdefault(key, []).append((line["step"], value))
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in logged] == [s for s, _ in points], key
        for (_, value), (_, want) in zip(logged, points):
            assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-9), (key, value, want)  # stored as float32
    (hparams,) = runs[0].rglob("hparams.yml")  # the run config, as accelerate's TensorBoard tracker stores it
    config = yaml.safe_load(hparams.read_text())
    assert config["train.learning_rate"] == 5e-3 and config["train.eval_every_steps"] == EVERY
    assert config["data.eval_sources"] == str([str(data["held_a"]), {"path": str(data["held_b"]), "name": "val_b"}])


def stand_alone(model_dir: Path, data, out: Path, *extra: str) -> dict:
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={model_dir}", eval_sources(data), f"train.output_dir={out}",
                                      "data.max_seq_len=160", *extra])
    result = evaluate(cfg, kit.load_recipe(RECIPE))
    assert json.loads((out / EVAL_FILE).read_text()) == result
    return result


def test_packed_evaluation_gives_the_unpacked_loss_whatever_the_packing_and_micro_batch(reference, data, tmp_path):
    """The trained model of the reference, evaluated padded one by one, padded 3 at a time, greedy-packed 2 packs
    at a time and bfd-packed: the same eval loss (<= 1e-5), per source too; the run's own last evaluation too."""
    model_dir = reference / "model"
    runs = {name: stand_alone(model_dir, data, tmp_path / name, *extra) for name, extra in {
        "padded_1": ["train.micro_batch_size=1"], "padded_3": ["train.micro_batch_size=3"],
        "greedy_2": ["+packing=greedy", "train.micro_batch_size=2"],
        "bfd_1": ["+packing=bfd", "train.micro_batch_size=1"]}.items()}
    assert runs["padded_1"]["eval_packs"] == 12 and runs["greedy_2"]["eval_packs"] < 12 and \
        runs["bfd_1"]["eval_packs"] < 12, "packing put several samples in a row"
    base = runs["padded_1"]
    for name, result in runs.items():
        assert result["eval_tokens"] == base["eval_tokens"] and result["eval_samples"] == 12, name
        for key in ("eval_loss", "eval_loss/held_a", "eval_loss/val_b"):
            assert abs(result[key] - base[key]) <= EVAL_TOL, (name, key, result[key], base[key])
    assert abs(kit.read_summary(reference)["eval"]["eval_loss"] - base["eval_loss"]) <= EVAL_TOL


@pytest.fixture(scope="module")
def adapted(data, tmp_path_factory) -> Path:
    """A LoRA run on the tiny, randomly initialised base (``lm_head`` trained beside the adapters), evaluated at its
    end."""
    out = tmp_path_factory.mktemp("eval_lora")
    kit.train(RECIPE, out, [f"data.sources=[{data['train']}]", eval_sources(data), "data.max_seq_len=160",
                            "+packing=greedy", "train.micro_batch_size=4", "train.learning_rate=5e-3",
                            "model.lora.r=4", "model.lora.modules_to_save=[lm_head]"])
    return out


def test_an_adapter_folder_of_a_fresh_base_evaluates_offline_as_its_run_did(adapted, data, tmp_path):
    """``model.pretrained=<run>/model`` alone: the folder holds the base the adapters were trained on (no path names
    a seeded init), so the loss is the run's own last evaluation, with the adapters applied, the hub never asked."""
    folder = adapted / "model"
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    trained = load_file(str(folder / "adapter_model.safetensors"))
    assert any(".lora_B." in key and value.abs().max() > 0 for key, value in trained.items()), "adapters untrained"
    result = stand_alone(folder, data, tmp_path, "+packing=greedy", "train.micro_batch_size=4")
    run = kit.read_summary(adapted)["eval"]
    for key in ("eval_loss", "eval_loss/held_a", "eval_loss/val_b"):
        assert abs(result[key] - run[key]) <= EVAL_TOL, (key, result[key], run[key])


@pytest.mark.parametrize("base", [None, "/nonexistent/base"])
def test_an_adapter_folder_without_its_base_stops_with_one_line(data, tmp_path, base):
    """Saved before adapters carried their base, or naming a base folder that is not here: one line naming the
    folder, instead of five retries against the model hub and a traceback."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={folder}", eval_sources(data), f"train.output_dir={tmp_path}"])
    expected = ("the adapter folder holds no base model" if base is None
                else f"the adapters' base {base} .* is not a folder on this machine")
    with pytest.raises(ConfigError, match=rf"^model.pretrained={folder}: {expected}") as err:
        evaluate(cfg, kit.load_recipe(RECIPE))
    assert "\n" not in str(err.value)


def test_the_model_loads_with_the_model_hub_off(data, saved, tmp_path, monkeypatch):
    """Whatever the environment says, a name that is no local folder must not start downloads or retries."""
    before, seen = huggingface_hub.constants.HF_HUB_OFFLINE, []

    def assemble(*args):
        seen.append(huggingface_hub.constants.HF_HUB_OFFLINE)
        raise ConfigError("stop here")

    monkeypatch.setattr(evaluate_module, "assemble", assemble)
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", eval_sources(data), f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="stop here"):
        evaluate(cfg, kit.load_recipe(RECIPE))
    assert seen == [True] and huggingface_hub.constants.HF_HUB_OFFLINE == before


@pytest.mark.launch
def test_two_context_parallel_ranks_evaluate_what_one_process_does(reference, data, tmp_path):
    """2 gloo ranks with ``train.context_parallel_size=2``: each rank computes the loss of its half of every row, the
    sums are reduced, rows and samples are counted once. (2 data-parallel ranks, each with its own packs: the FSDP2
    run below.)"""
    one = stand_alone(reference / "model", data, tmp_path / "one", "+packing=greedy", "train.micro_batch_size=1")
    run_on_ranks(2, evaluate_job, RECIPE, str(tmp_path / "two"), [
        f"model.pretrained={reference / 'model'}", eval_sources(data), "data.max_seq_len=160", "+packing=greedy",
        "train.micro_batch_size=1", "train.context_parallel_size=2"])
    two = json.loads((tmp_path / "two" / EVAL_FILE).read_text())
    assert (two["world_size"], two["context_parallel_size"]) == (2, 2)
    assert (two["eval_samples"], two["eval_packs"], two["eval_tokens"]) == \
        (one["eval_samples"], one["eval_packs"], one["eval_tokens"])
    for key in ("eval_loss", "eval_loss/held_a", "eval_loss/val_b"):
        assert abs(two[key] - one[key]) <= EVAL_TOL, (key, two[key], one[key])


def test_held_out_records_left_out_are_counted_and_said(data, saved, tmp_path, capsys):
    """Overlong eval samples are dropped as in training (``data.overlong=drop``), never silently: the console says
    how many, the ledger counts them and still reconciles, and the loss covers the rest."""
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", eval_sources(data), f"train.output_dir={tmp_path}",
                                      "data.max_seq_len=40"])
    result = evaluate(cfg, kit.load_recipe(RECIPE))
    records = result["records"]
    dropped = sum(sum(entry["dropped"].values()) for entry in records.values())
    assert 0 < dropped < 12 and set().union(*(entry["dropped"] for entry in records.values())) == {"overlong"}
    assert all(entry["reconciles"] for entry in records.values())
    assert result["eval_samples"] == 12 - dropped
    assert re.search(r"eval data \w+: \d+ of \d+ records left out, by reason \{'overlong': \d+\}",
                     capsys.readouterr().out)


def test_bad_eval_records_count_toward_the_bad_fraction_of_their_source(saved, tmp_path):
    """An eval source is held to ``data.max_bad_fraction`` on its own: a third of it broken stops before any model
    runs when reading and measuring find too many, and after the evaluation when the corrupt image body only
    decoding finds tips it over; the line names the source."""
    data, expected = write_messy_jsonl(tmp_path / "messy", num_records=27)
    found_before = sum(reason not in {"corrupt_image"} for reason in expected.values())
    assert (found_before, len(expected)) == (8, 9)
    for limit, bad in (("0.01", found_before), ("0.3", len(expected))):
        cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", f"data.eval_sources=[{data}]",
                                          f"train.output_dir={tmp_path}", f"data.max_bad_fraction={limit}"])
        with pytest.raises(TooManyBadRecords) as err:
            evaluate(cfg, kit.load_recipe(RECIPE))
        assert str(err.value).startswith(f"data.eval_sources: messy: {bad} of 27 records are bad "), str(err.value)
        assert "\n" not in str(err.value)


def test_evaluate_without_eval_sources_stops_with_one_line(saved, tmp_path, capsys):
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", f"train.output_dir={tmp_path}"])
    with pytest.raises(SystemExit):
        evaluate_recipe(cfg, kit.load_recipe(RECIPE))
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("config error: data.eval_sources is empty")


def test_evaluate_without_a_saved_model_refuses_naming_model_pretrained(data, tmp_path, capsys):
    """A random model's eval loss looks like a result: ``evaluate`` scores only ``model.pretrained``, and says so
    before it builds anything."""
    cfg = kit.compose_config(RECIPE, [eval_sources(data), f"train.output_dir={tmp_path}"])
    with pytest.raises(SystemExit):
        evaluate_recipe(cfg, kit.load_recipe(RECIPE))
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("config error: model.pretrained is not set: "), err
    assert not (tmp_path / EVAL_FILE).exists()


def test_a_source_with_every_record_left_out_stops_the_evaluation_naming_it(data, saved, tmp_path):
    """Every held-out record overlong: no loss of 0, one line naming the source and the reason, before any model
    runs. The training run's evaluator is built the same way: below."""
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", eval_sources(data), f"train.output_dir={tmp_path}",
                                      "data.max_seq_len=8"])
    with pytest.raises(ConfigError, match=r"^data.eval_sources: held_a: none of its 7 records can be evaluated, by "
                                          r"reason \{'overlong': 7\}: raise data.max_seq_len"):
        evaluate(cfg, kit.load_recipe(RECIPE))
    assert not (tmp_path / EVAL_FILE).exists()


def test_a_training_run_whose_eval_source_is_all_bad_stops_before_its_first_step(data, tmp_path):
    """Every record of the eval source names a missing image (bad, allowed by ``data.max_bad_fraction=1``): the run
    stops at assembly, not after training with an eval loss of 0."""
    held = tmp_path / "missing.jsonl"
    held.write_text("".join(json.dumps({"id": f"m{i}", "image": str(tmp_path / f"gone{i}.png"), "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "w1 w2"}]}) + "\n" for i in range(3)))
    run = kit.train(RECIPE, tmp_path / "run", [f"data.sources=[{data['train']}]", f"data.eval_sources=[{held}]",
                                               "data.max_bad_fraction=1.0", "data.max_seq_len=160"], check=False)
    assert run.returncode == 1
    assert re.fullmatch(r"config error: data.eval_sources: missing: none of its 3 records can be evaluated, by reason "
                        r"\{'\w+': 3\}: .*", run.stderr.strip().splitlines()[-1]), run.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_supervised_token_evaluated_is_a_loss_of_none_with_its_reason():
    """Samples planned can still all turn out bad when decoded (within ``data.max_bad_fraction``): the loss is None
    with the reason, in eval.json, metrics.jsonl and the printed line; never 0."""
    sums = torch.tensor([[6.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    some = eval_metrics(["a", "b"], sums)
    assert (some[EVAL_LOSS], some[f"{EVAL_LOSS}/a"], some[f"{EVAL_LOSS}/b"]) == (2.0, 2.0, None)
    assert NO_LOSS not in some and describe(some) == "eval_loss 2.0000 over 3 tokens of 2 samples"
    none = eval_metrics(["b"], sums[1:])
    assert none[EVAL_LOSS] is None and "bad record" in none[NO_LOSS]
    assert describe(none).startswith("eval_loss none (no sample was evaluated: ")


def test_two_eval_sources_given_one_name_are_refused_with_one_line(data, saved, tmp_path):
    cfg = kit.compose_config(RECIPE, [f"model.pretrained={saved}", f"train.output_dir={tmp_path}",
                                      f"data.eval_sources=[{{path:{data['held_a']},name:val}},"
                                      f"{{path:{data['held_b']},name:val}}]"])
    with pytest.raises(ConfigError, match=r"data.eval_sources\[1\]: name 'val' is already used by "
                                          r"data.eval_sources\[0\]"):
        evaluate(cfg, kit.load_recipe(RECIPE))


@pytest.mark.parametrize("override,line", [
    ("train.report_to=[tensorbored]", r"train.report_to: 'tensorbored' is unknown"),
    ("train.report_to=[tensorboard,tensorboard]", r"train.report_to=.* names a tracker twice"),
    ("train.eval_every_steps=-1", r"train.eval_every_steps=-1 is invalid"),
    ("data.eval_sources=[/nonexistent/held.jsonl]", r"data.eval_sources: "),
    ("data.eval_sources=[{path:/d/held.jsonl,repeat:2}]", r"data.eval_sources\[0\]: repeat=2 does not apply"),
    ("data.eval_sources=[{path:/d/held.jsonl,weight:2}]", r"data.eval_sources\[0\]: unknown key 'weight'"),
])
def test_bad_eval_and_tracker_settings_fail_naming_the_key(override, line):
    with pytest.raises(ConfigError, match=line):
        resolve_run_specs(kit.compose_config(RECIPE, [override]), kit.load_recipe(RECIPE).attention_backends)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_whose_package_is_missing_names_the_pip_install(monkeypatch, name):
    monkeypatch.setattr(trackers, "installed", lambda package: package != name)
    with pytest.raises(ConfigError, match=rf"^train.report_to: '{name}' needs the {name} package: pip install {name}$"):
        resolve_run_specs(kit.compose_config(RECIPE, [f"train.report_to=[{name}]"]),
                          kit.load_recipe(RECIPE).attention_backends)


@pytest.mark.launch
def test_a_two_rank_fsdp2_run_evaluates_its_model_as_one_process_does(data, tmp_path):
    """2 gloo ranks training under FSDP2 (every rank runs the vision tower in every eval forward, as FSDP2's gathers
    need; DDP's ranks each hold the whole model, the stand-alone 2-rank case): the run's final eval_loss is the
    stand-alone one-process evaluation of its saved model. With a tracker: it is closed without ending the process
    group the end-of-run gathers use; rank 0 alone writes its event file."""
    run_dir = tmp_path / "run"
    overrides = [o for o in run_overrides(data, run_dir) if not o.startswith(("train.output_dir", "train.epochs"))]
    kit.train(RECIPE, run_dir, [*overrides, "train.epochs=1", "train.sharding=fsdp2", "train.report_to=[tensorboard]"],
             nproc=2)
    summary = kit.read_summary(run_dir)
    evals = eval_lines(kit.read_metrics(run_dir))
    assert summary["world_size"] == 2 and [m["step"] for m in evals][-1] == summary["actual_steps"]
    assert evals[-1]["eval_samples"] == 12 and summary["eval"]["eval_loss"] == evals[-1]["eval_loss"]
    assert len(list((run_dir / "tensorboard" / RECIPE).glob("events.out.tfevents.*"))) == 1
    one = stand_alone(run_dir / "model", data, tmp_path / "one", "+packing=greedy", "train.micro_batch_size=1")
    for key in ("eval_loss", "eval_loss/held_a", "eval_loss/val_b"):
        assert abs(evals[-1][key] - one[key]) <= EVAL_TOL, (key, evals[-1][key], one[key])
