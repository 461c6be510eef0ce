"""dpo.reference=precomputed and held-out pairs under train.objective=dpo, through the real trainer (in-process, tiny
llava, the testkit's pairs).

The runs fine-tune the whole model (no adapters), so the frozen copy is a second model the policy moves away from.
Each epoch is one optimizer step over every pair and the eval source is the training file itself, evaluated after
every step: the evaluation after step 1 sees the weights step 2 trains from, on the same pairs, so its metrics are
step 2's training metrics computed without an update.

- ``precomputed`` (one pass before training, then a lookup by record key) logs what ``copy`` (a second model run
  every step) logs, training and eval lines alike;
- a second run with the same data, model and settings reads the cache instead of computing it, and trains the same;
- a pair id that names two different pairs is refused in one line;
- the stand-alone evaluation of a saved LoRA policy (its base the reference) gives the run's own last evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mvp_engine.engine.checkpoint import CHECKPOINTS
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.evaluate import evaluate
from mvp_engine.engine.evaluation import NOTHING_DECODED, describe, eval_metrics, pair_eval_metrics
from mvp_engine.engine.preference import METRICS
from mvp_engine.engine.testkit.launch import read_metrics, read_summary
from mvp_engine.engine.testkit.preference import write_pairs
from mvp_engine.engine.testkit.runs import train
from mvp_engine.engine.testkit.structure import compose_config, load_recipe

BASE = ["+packing=greedy", "train.objective=dpo", "train.epochs=2", "data.max_seq_len=160", "train.warmup_ratio=0",
        "data.max_bad_fraction=0.5", "train.log_every=1", "dpo.beta=0.5", "dpo.label_smoothing=0.1",
        "train.learning_rate=0.002", "train.micro_batch_size=16", "train.gradient_accumulation_steps=1",
        "train.eval_every_steps=1"]
PAIR_METRICS = ("loss", *METRICS)
EVAL_METRICS = ("eval_loss", *(f"eval_{key}" for key in METRICS))


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("dpo_pairs"), bad=True, copies=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pairs_file):
    """The same run with a frozen copy, precomputed (cache cold), precomputed again (cache warm)."""
    root = tmp_path_factory.mktemp("dpo_reference")
    data = [f"data.sources=[{pairs_file}]", f"data.eval_sources=[{pairs_file}]", f"data.cache_dir={root / 'cache'}"]
    for name, reference in (("copy", "copy"), ("cold", "precomputed"), ("warm", "precomputed")):
        train("llava", root / name, [*BASE, *data, f"dpo.reference={reference}", "train.save_every_steps=1"])
    return root


def _lines(run_dir, kind):
    lines = read_metrics(run_dir)
    return [line for line in lines if ("eval_loss" in line) == (kind == "eval")]


def _close(a: dict, b: dict, keys) -> None:
    for key in keys:
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])


def _same_runs(one: list[dict], two: list[dict]) -> None:
    """Training and eval lines equal to 1e-5, where the reference log-probabilities come from packs laid out
    differently (the pass packs each source in record order, the copy runs in the step's packs)."""
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        keys = EVAL_METRICS if "eval_loss" in a else (*PAIR_METRICS, "grad_norm")
        if abs(a.get("rewards/margin", 1.0)) < 1e-5:
            # step 1: the policy is its reference, every pair ties and rounding decides "chosen > rejected"
            keys = [key for key in keys if key != "rewards/accuracy"]
        _close(a, b, keys)


def test_eval_equals_the_training_step_on_the_same_weights(runs):
    steps, evals = _lines(runs / "copy", "train"), _lines(runs / "copy", "eval")
    assert [line["step"] for line in steps] == [1, 2] and [line["step"] for line in evals] == [1, 2]
    assert evals[0]["eval_pairs"] == evals[0]["eval_samples"] == 9  # every good pair, the bad ones counted
    assert steps[1]["rewards/margin"] != 0, "step 1 moved the policy off its reference"
    # the evaluation after step 1 is step 2's forward without its update
    _close(evals[0], {f"eval_{key}": value for key, value in steps[1].items()}, EVAL_METRICS)


def test_precomputed_reference_trains_as_the_copy(runs):
    cold = read_metrics(runs / "cold")
    _same_runs(read_metrics(runs / "copy"), cold)
    # the pass ran once over the one file (a training and an eval source) and was cached; the rerun read it
    assert read_summary(runs / "cold")["dpo_reference"] == {"computed": 1, "read": 0, "pairs": 9}
    assert read_summary(runs / "warm")["dpo_reference"] == {"computed": 0, "read": 1, "pairs": 9}
    assert read_metrics(runs / "warm") == cold


def test_precomputed_resume_without_the_cache_keeps_the_initial_reference(runs, tmp_path, pairs_file):
    """A resume whose cache is gone runs the pass again on the model as built, before the checkpoint is loaded: the
    rest of the run is the uninterrupted one's, bit for bit (a pass on the resumed weights would zero the rewards)."""
    checkpoint = runs / "cold" / CHECKPOINTS / "step_00000001"
    data = [f"data.sources=[{pairs_file}]", f"data.eval_sources=[{pairs_file}]", f"data.cache_dir={tmp_path}"]
    train("llava", tmp_path / "resumed", [*BASE, *data, "dpo.reference=precomputed", "train.save_every_steps=1",
                                          f"train.resume_from={checkpoint}"])
    assert read_summary(tmp_path / "resumed")["dpo_reference"]["computed"] == 1
    assert read_metrics(tmp_path / "resumed") == read_metrics(runs / "cold")[2:]


def test_precomputed_refuses_an_id_naming_two_pairs(tmp_path, pairs_file):
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()][:2]
    rows[1]["id"] = rows[0]["id"]
    clash = pairs_file.parent / "clash.jsonl"  # beside the images the pairs name
    clash.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = train("llava", tmp_path / "run", [*BASE, f"data.sources=[{clash}]", f"data.cache_dir={tmp_path}",
                                               "dpo.reference=precomputed"], check=False)
    assert result.returncode != 0
    assert f"dpo.reference=precomputed looks pairs up by their record key: {rows[0]['id']!r} names two different " \
           "pairs" in result.stdout + result.stderr


@pytest.mark.launch
@pytest.mark.slow
def test_precomputed_on_two_ranks(runs, tmp_path, pairs_file):
    """Each rank computes its share of the pass and every rank looks up the union: 2 ranks x 8 packs train as 1 rank
    x 16, and the cache they write holds the same pairs' log-probabilities."""
    data = [f"data.sources=[{pairs_file}]", f"data.eval_sources=[{pairs_file}]", f"data.cache_dir={tmp_path}"]
    shape = [o for o in BASE if not o.startswith("train.micro_batch_size")] + ["train.micro_batch_size=8"]
    train("llava", tmp_path / "ranks", [*shape, *data, "dpo.reference=precomputed"], nproc=2)
    assert read_summary(tmp_path / "ranks")["dpo_reference"] == {"computed": 1, "read": 0, "pairs": 9}
    _same_runs(read_metrics(tmp_path / "ranks"), read_metrics(runs / "cold"))
    (two,), (one,) = ([json.loads(p.read_text())["entries"] for p in (folder / "dpo_reference").glob("*.json")]
                      for folder in (tmp_path, runs / "cache"))
    assert sorted(two) == sorted(one)
    for key, entry in one.items():
        assert two[key][0] == entry[0] and two[key][3:] == entry[3:]  # content digest, token counts
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(two[key][1:3], entry[1:3])), key


def test_evaluate_entry_on_a_saved_lora_policy(tmp_path, pairs_file):
    data = [f"data.sources=[{pairs_file}]", f"data.eval_sources=[{pairs_file}]", f"data.cache_dir={tmp_path}"]
    lora = ["model.lora.r=4", "train.learning_rate=0.05"]
    train("llava", tmp_path / "run", [*BASE, *data, *lora])
    last = read_summary(tmp_path / "run")["eval"]
    assert last["eval_rewards/margin"] != 0

    def stand_alone(*extra):
        cfg = compose_config("llava", ["+packing=greedy", "train.objective=dpo", "data.max_seq_len=160",
                                       "data.max_bad_fraction=0.5", "dpo.beta=0.5", "dpo.label_smoothing=0.1",
                                       f"model.pretrained={tmp_path / 'run' / 'model'}", *data[1:],
                                       f"train.output_dir={tmp_path / 'eval'}", *extra])
        return evaluate(cfg, load_recipe("llava"))

    _close(stand_alone("train.micro_batch_size=2"), last, [*EVAL_METRICS, "eval_pairs"])
    with pytest.raises(ConfigError, match="^evaluate: dpo.reference=copy has no reference for a saved policy"):
        stand_alone("dpo.reference=copy")


def test_pair_eval_metrics_are_none_without_pairs():
    """Per source and overall, the pairs' means; a source with no pair evaluated has none, never 0."""
    totals = torch.zeros(2, len(METRICS) + 1, dtype=torch.float64)
    totals[0] = torch.tensor([1.0, -1.0, 2.0, 1.0, -10.0, -12.0, 2.0])  # METRICS' sums over 2 pairs, then the count
    metrics = pair_eval_metrics(["a", "b"], totals)
    assert metrics["eval_rewards/margin"] == metrics["eval_rewards/margin/a"] == 1.0
    assert metrics["eval_rewards/accuracy"] == 0.5 and metrics["eval_logps/rejected"] == -6.0
    assert metrics["eval_rewards/margin/b"] is None
    none = {**eval_metrics(["b"], torch.zeros(1, 4, dtype=torch.float64), "pairs"),
            **pair_eval_metrics(["b"], totals[1:])}
    assert none["eval_loss"] is None and none["eval_rewards/accuracy"] is None
    assert describe(none) == f"eval_loss none ({NOTHING_DECODED}) over 0 pairs"
