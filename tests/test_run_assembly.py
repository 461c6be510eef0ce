"""The one run assembly (``mvp_engine/engine/run.py``) and what it relies on: ``model.*`` validated once into a
``ModelSpec``, a plan assembled as the trainer's run is (its cost profile, its dataset's rank split and step
shape), a dataset that keeps the step shape it was built with, and the CP shard alive only inside a
sequence-parallel forward (and a recomputed layer's replay of it), never for the process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mvp_engine.engine.config import ConfigError, ModelSpec, compose_config, model_spec, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.flops import planning_cost_profile
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.run import assemble
from mvp_engine.kit.mllm.data import MLLMDataKit, MLLMDataSpec, MLLMPackingSpec
from mvp_engine.packing import SequenceShard, replay_sequence_shard, sequence_shard, sequence_sharded
from tests.fakes import FakeEncoder, fake_record

RECIPE = "llava"


def test_the_model_spec_holds_the_engine_keys_and_keeps_the_familys():
    cfg = compose_config("qwen2_vl", ["model.seed=3", "model.freeze=[model.visual]", "model.lora.r=2"])
    spec = resolve_run_specs(cfg, load_recipe("qwen2_vl").attention_backends).model
    assert (spec.pretrained, spec.seed, spec.dtype, spec.freeze, spec.lora.r) == (None, 3, "float32",
                                                                                 ["model.visual"], 2)
    assert spec.config["text_config"]["hidden_size"] == 64
    assert spec.extra["name"] == "qwen2_vl" and "image_max_pixels" in spec.extra
    assert model_spec({"seed": None, "dtype": None, "freeze": None}) == ModelSpec()  # null: the default


@pytest.mark.parametrize(("override", "line"), [
    ("model.seed=-1", "model.seed=-1 is invalid: allowed an int >= 0"),
    ("model.dtype=float33", "model.dtype='float33' is invalid: allowed a torch dtype name"),
    ("model.freeze=model.visual", "model.freeze='model.visual' is invalid: allowed a list of module-name patterns"),
    ("model.lora.r=-2", "model.lora.r=-2 is invalid"),
])
def test_a_bad_model_value_is_one_line_naming_the_key(override, line):
    cfg = compose_config(RECIPE, [override])
    with pytest.raises(ConfigError) as stopped:
        resolve_run_specs(cfg, load_recipe(RECIPE).attention_backends)
    assert str(stopped.value).startswith(line)


def test_a_plan_is_the_runs_model_and_dataset_without_processes(tmp_path):
    """Rank 0 of 4 processes in CP groups of 2: the data split over the 2 data-parallel ranks, the dataset in the
    run's step shape, and the cost profile ``planning_cost_profile`` reads (LoRA and freezing applied)."""
    overrides = ["+packing=greedy", "train.context_parallel_size=2", "train.micro_batch_size=2",
                 "train.gradient_accumulation_steps=3", "model.lora.r=2", f"demo.out_dir={tmp_path / 'demo'}",
                 "demo.num_samples=24"]
    cfg = with_demo_data(compose_config(RECIPE, overrides))
    plan = assemble(cfg, load_recipe(RECIPE), "plan", world_size=4)
    assert (plan.world_size, plan.layout.dp_size, plan.dataset.world_size, plan.dataset.rank) == (4, 2, 2, 0)
    assert (plan.dataset.micro_batch_size, plan.dataset.gradient_accumulation_steps) == (2, 3)
    assert all(p.is_meta for p in plan.model.parameters()) and plan.layout.mesh is None
    assert plan.cost_profile == planning_cost_profile(plan.recipe, cfg.model)
    assert plan.parameters.trainable < plan.parameters.total  # the adapters train, the base is frozen
    with pytest.raises(ConfigError, match="context_parallel_size=2 splits packed rows"):
        assemble(with_demo_data(compose_config(RECIPE, overrides[1:])), load_recipe(RECIPE), "plan", 4)


def test_the_dataset_keeps_the_step_shape_it_was_built_with():
    records = [fake_record(i, 3 + i % 7) for i in range(60)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=16, strategy="greedy", buffer_size=8), seed=2)
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records, world_size=2, drop_last=True,
                                        micro_batch_size=5, gradient_accumulation_steps=2)
    assert dataset.worker_batch_size == 5  # DataLoader workers hand out whole micro-batches
    assert dataset.estimate_total_steps(2) == dataset.estimate_total_steps(2, 5, 2)
    assert dataset.epoch_ledger(epoch=1) == dataset.epoch_ledger(5, 1)
    # 12 packs per rank: 2 micro-batches of 5 leave 2 packs each out, micro-batches of 1 none
    assert dataset.dropped_records(epoch=0) == dataset.dropped_records(5, 0) != dataset.dropped_records(1, 0)
    assert dataset.left_out_by_drop_last() and not dataset.left_out_by_drop_last(1)


def test_the_cp_shard_is_set_only_inside_the_forward():
    outer, inner = SequenceShard(None, 0, 2), SequenceShard(None, 1, 2)
    assert sequence_shard() is None
    with sequence_sharded(outer):
        assert sequence_shard() is outer
        with sequence_sharded(inner):
            assert sequence_shard() is inner
        assert sequence_shard() is outer
    assert sequence_shard() is None


def test_a_sequence_parallel_attention_outside_a_cp_forward_is_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="ran outside a sequence-parallel forward"):
        ALL_ATTENTION_FUNCTIONS["ulysses_sdpa"](torch.nn.Module(), q, q, q, None)
    with sequence_sharded(SequenceShard(None, 0, 1)):  # a group of one: the backend itself
        out, _ = ALL_ATTENTION_FUNCTIONS["ulysses_sdpa"](torch.nn.Module(), q, q, q, None, is_causal=True)
    assert out.shape == (1, 4, 2, 8)


def test_a_recomputed_layer_replays_under_the_shard_its_forward_saw():
    """Activation checkpointing recomputes in backward, after the forward's shard was left."""
    shard, seen = SequenceShard(None, 0, 2), []

    def layer(x):
        seen.append(sequence_shard())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    with sequence_sharded(shard):
        y = checkpoint(layer, x, use_reentrant=False, context_fn=replay_sequence_shard)
    y.sum().backward()
    assert seen == [shard, shard] and sequence_shard() is None
