"""Activation checkpointing (``mvp_engine.engine.recompute``): the saved-bytes counter counts what autograd keeps, a
model that cannot recompute is refused with one line, the testkit's check fails when nothing recomputes, and a
training run with ``train.activation_checkpointing=true`` trains exactly what the run without it trains.

Per recipe, on the packed case, the testkit's ``EquivalenceSuite`` checks loss and gradients with and without
recomputation (``recipes/*/tests/test_packed_equivalence.py``)."""

from __future__ import annotations

import pytest
import torch

import mvp_engine.engine.testing as kit
import mvp_engine.engine.testkit.recompute as recompute_check
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.recompute import SavedForBackward, checkpointing_layers, enable_activation_checkpointing
from mvp_engine.engine.testkit.smoke import smoke_trainer

RECIPE = "llava"  # the wiring is recipe-free; every recipe's exactness is its EquivalenceSuite's
COVERS = ("recompute",)  # on RECIPE, for the coverage table (testkit.coverage)


def test_saved_bytes_count_each_saved_storage_once_and_no_parameter():
    """Linear -> ReLU -> Linear: the first linear saves its input, ReLU its output, which the second linear saves
    again (one storage); the weights are saved too but exist anyway."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    with SavedForBackward(model) as saved:
        model(x).sum().backward()
    assert saved.bytes == (5 * 8 + 5 * 16) * 4
    with SavedForBackward(model) as saved, torch.no_grad():
        model(x)
    assert saved.bytes == 0


def test_a_model_with_a_repeated_block_that_cannot_recompute_is_refused_with_one_line(tmp_path):
    case = kit.equivalence_case("llava", tmp_path)
    model = case.recipe.build_model(case.model_cfg, "sdpa")
    model._no_split_modules = [*model._no_split_modules, "CLIPMLP"]  # repeated per CLIP layer, no checkpoint layer
    with pytest.raises(ConfigError, match=r"cannot recompute its layers \(its blocks \['CLIPMLP'\] are not"):
        enable_activation_checkpointing(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_the_check_fails_when_nothing_recomputes(tmp_path, monkeypatch):
    case = kit.equivalence_case("llava", tmp_path)
    monkeypatch.setattr(recompute_check, "enable_activation_checkpointing", lambda model: None)
    failures = kit.run_recompute_check(case, "sdpa").failures()
    assert any("ran again in backward, the loss reached" in f for f in failures), failures
    assert any(f.startswith("saved for backward") for f in failures), failures


def test_training_with_activation_checkpointing_trains_what_training_without_does(tmp_path):
    """The same losses, step by step, and the summary says which run recomputed."""
    overrides = ("demo.num_samples=16", "demo.videos=false", "train.epochs=1", "train.micro_batch_size=1")
    trainers = {on: smoke_trainer(RECIPE, "greedy", tmp_path / str(on),
                                  (*overrides, f"train.activation_checkpointing={str(on).lower()}"))
                for on in (False, True)}
    for on, trainer in trainers.items():
        assert {layer.gradient_checkpointing for layer in checkpointing_layers(trainer.model)} == {on}
    runs = {on: trainer.run() for on, trainer in trainers.items()}
    assert [runs[on]["activation_checkpointing"] for on in (False, True)] == [False, True]
    plain, recomputed = runs[False]["losses"], runs[True]["losses"]
    assert len(plain) == len(recomputed) >= 2
    assert max(abs(a - b) for a, b in zip(plain, recomputed)) <= 1e-6


@pytest.mark.slow
def test_fsdp2_with_recomputation_on_two_ranks_trains_what_fsdp2_without_trains(tmp_path):
    """qwen3_5 sharded on 2 gloo ranks: its linear-attention layers and vision blocks recompute inside FSDP2's
    unshard / reshard hooks. Unpacked, one sample per micro-batch, on data alternating image and text-only records:
    at each step one rank runs the dummy media pass (recomputed too) while the other encodes an image."""
    common = [f"data.sources=[{kit.shared_mixed_jsonl()}]", "data.shuffle=false", "data.max_seq_len=160",
              "train.epochs=2", "train.micro_batch_size=1", "train.learning_rate=5e-3", "train.sharding=fsdp2"]
    for on in ("false", "true"):
        kit.train("qwen3_5", tmp_path / on, [*common, f"train.activation_checkpointing={on}"], nproc=2)
    plain, recomputed = kit.read_metrics(tmp_path / "false"), kit.read_metrics(tmp_path / "true")
    assert len(plain) == len(recomputed) >= 10
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(plain, recomputed)) <= 1e-6
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(plain, recomputed)) <= 1e-6
    difference = kit.max_weight_difference(kit.final_weights(tmp_path / "false"), kit.final_weights(tmp_path / "true"))
    assert difference <= 1e-6, f"parameters differ by {difference}"
    summary = kit.read_summary(tmp_path / "true")
    assert (summary["world_size"], summary["sharding"], summary["activation_checkpointing"]) == (2, "fsdp2", True)
