"""Context parallelism's engine parts: the DP x CP mesh trains what DP alone trains (4 gloo processes), the layout
and its config errors, the media shares, the chunk and the loss of a chunk. The per-recipe exactness checks are the
recipes' ``ContextParallelSuite``."""

from types import SimpleNamespace

import pytest
import torch

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.context_parallel import ParallelLayout, build_layout, make_sequence_parallel, row_multiple
from mvp_engine.engine.loss import token_weights, weighted_token_loss
from mvp_engine.packing import SequenceShard, inner_backend, local_model_kwargs
from mvp_engine.packing.sequence_media import shares


@pytest.mark.slow
def test_dp2_by_cp2_on_four_processes_trains_what_dp2_trains(tmp_path):
    print(kit.check_split_training("llava", tmp_path, split=(4, 2), reference=(2, 1), epochs=2))


@pytest.mark.slow
def test_cp2_with_fsdp2_and_recomputation_trains_what_one_process_trains(tmp_path):
    """Qwen3-VL (clips, DeepStack): FSDP2 shards over the whole world (both CP ranks), the recomputed layers run
    their all-to-alls again in backward."""
    print(kit.check_split_training("qwen3_vl", tmp_path, split=(2, 2), reference=(1, 1),
                                   split_overrides=("train.sharding=fsdp2", "train.activation_checkpointing=true")))


def _accelerator(processes: int):
    return SimpleNamespace(num_processes=processes, process_index=0, device=torch.device("cpu"))


def test_a_cp_size_that_does_not_divide_the_world_names_the_key():
    with pytest.raises(ConfigError, match=r"train.context_parallel_size=2 does not divide the 3 processes"):
        build_layout(_accelerator(3), 2, packed=True)


def test_context_parallelism_needs_packed_rows():
    with pytest.raises(ConfigError, match=r"train.context_parallel_size=2 splits packed rows: add \+packing"):
        build_layout(_accelerator(2), 2, packed=False)


def test_heads_that_do_not_split_are_one_line_naming_the_numbers():
    recipe = kit.load_recipe("qwen3_5")
    model = recipe.build_model(kit.compose_config("qwen3_5").model, "sdpa")
    layout = ParallelLayout(world_size=3, rank=0, cp_size=3, shard=SequenceShard(None, 0, 3))
    with pytest.raises(ConfigError) as stopped:
        make_sequence_parallel(model, layout)
    line = str(stopped.value)
    assert line.startswith("train.context_parallel_size=3: Ulysses splits heads over the CP group")
    for key in ("num_attention_heads=4", "num_key_value_heads=2", "linear_num_key_heads=2",
                "linear_num_value_heads=4"):
        assert key in line
    assert inner_backend(model.config.text_config._attn_implementation) == "sdpa"  # left as it was


def test_per_layer_heads_are_checked_layer_by_layer():
    """Gemma 4's full-attention layer has one key/value head: it cannot split over 2 ranks, and the line says where."""
    model = kit.load_recipe("gemma4").build_model(kit.compose_config("gemma4").model, "sdpa")
    layout = ParallelLayout(world_size=2, rank=0, cp_size=2, shard=SequenceShard(None, 0, 2))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=1 \(layers 2\) is not divisible by 2"):
        make_sequence_parallel(model, layout)


def test_layout_coordinates_and_row_multiple():
    layouts = [ParallelLayout(world_size=4, rank=r, cp_size=2) for r in range(4)]
    assert [(x.dp_rank, x.dp_size, x.counts_rows) for x in layouts] == [(0, 2, True), (0, 2, False), (1, 2, True),
                                                                        (1, 2, False)]
    assert row_multiple(None, 1) is None and row_multiple(8, 1) == 8
    assert row_multiple(None, 2) == 2 and row_multiple(3, 2) == 6 and row_multiple(8, 4) == 8


def test_shares_are_contiguous_and_about_even_by_patches():
    assert shares([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert shares([16, 1, 1, 1], 2) == [(0, 1), (1, 4)]  # items are never cut
    assert shares([5], 2) == [(0, 1), (1, 1)]  # one item: the other rank encodes the dummy
    assert shares([], 2) == [(0, 0), (0, 0)]


def test_the_chunk_of_positions_and_ids_and_the_rest_whole():
    shard = SequenceShard(None, 1, 2)
    kwargs = {"input_ids": torch.arange(12).reshape(2, 6), "position_ids": torch.arange(48).reshape(4, 2, 6),
              "attention_mask": torch.ones(2, 1, 6, 6)}
    local = local_model_kwargs(kwargs, shard)
    assert local["input_ids"].tolist() == [[3, 4, 5], [9, 10, 11]]
    assert local["position_ids"].shape == (4, 2, 3) and local["position_ids"][0, 0].tolist() == [3, 4, 5]
    assert local["attention_mask"] is kwargs["attention_mask"]
    with pytest.raises(ValueError, match="does not split into 2 equal chunks"):
        shard.span(7)


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_the_chunks_losses_add_up_to_the_whole_rows(reduction):
    """Position q predicts token q + 1 across a chunk's edge; a sample's weight counts its tokens on both ranks."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 11, (2, 8), generator=generator)
    labels[0, :2] = -100
    segments = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 1, 1, 1, 1]])
    logits = torch.randn(2, 8, 11, generator=generator)
    whole = weighted_token_loss(logits, labels, segments, reduction)
    parts = [weighted_token_loss(logits[:, a:b], labels, segments, reduction, (a, b)) for a, b in ((0, 4), (4, 8))]
    assert torch.allclose(sum(p.weighted_sum for p in parts), whole.weighted_sum, atol=1e-6)
    assert torch.allclose(sum(token_weights(labels, segments, reduction, span).sum() for span in ((0, 4), (4, 8))),
                          token_weights(labels, segments, reduction).sum())


def test_planning_splits_rows_over_data_parallel_ranks_only(tmp_path):
    """The step estimate and the report of a 4-process CP = 2 run are those of 2 data-parallel ranks."""
    from mvp_engine.engine.demo import with_demo_data
    from mvp_engine.engine.plan_report import estimate_from_dataset
    from mvp_engine.engine.run_data import planning_dataset

    def plan(world: int, cp: int):
        cfg = with_demo_data(kit.compose_config("llava", ["+packing=greedy", f"train.context_parallel_size={cp}",
                                                          f"demo.out_dir={tmp_path / 'demo'}"]))
        planning = planning_dataset(cfg, kit.load_recipe("llava"), world)
        return planning, estimate_from_dataset(planning.dataset, planning.specs.train)

    (split, split_estimate), (reference, reference_estimate) = plan(4, 2), plan(2, 1)
    assert split.world_size == 4 and split.dataset.world_size == reference.dataset.world_size == 2
    assert split_estimate["total_optimizer_steps"] == reference_estimate["total_optimizer_steps"]
    assert split_estimate["context_parallel_size"] == 2
    with pytest.raises(ConfigError, match="context_parallel_size=2 does not divide the 3 processes"):
        plan(3, 2)
