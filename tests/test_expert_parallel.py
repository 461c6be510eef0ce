"""``train.expert_parallel_size``: the tiny Qwen3.5-MoE's experts (4 per layer, top-2) split over 2 gloo ranks, tokens
dispatched all-to-all, with the load-balancing loss on: under FSDP2, from a pretrained folder, it trains what 1 rank x
accumulation 2 trains (losses, aux loss, grad norms, expert load, gathered final weights) and its mid-run checkpoint
resumes the rest of the run exactly (each EP rank's expert slices under their own checkpoint keys); so does CP 2 x EP 2
on 4 ranks under FSDP2 (2 replicas of each expert slice, their gradients reduced between them); under DDP with CP 2 on
2 ranks it trains what one process trains; the refusals, one line each; the final save of split experts writes what
a save without them writes (in process, on qwen3_vl_moe, whose experts' reverse conversion depends on the model's
shapes). (qwen3_vl_moe and glm4v_moe: EP 2 in their ``test_distributed.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.expert_parallel import SPLIT_NAMES, check_expert_parallel, expert_modules, saved_whole

RECIPE = "qwen3_5_moe"
COVERS = ("EP",)  # for the coverage table (testkit.coverage)
COMMON = ("+packing=greedy", "data.shuffle=false", "data.max_seq_len=160", "train.epochs=2",
          "train.micro_batch_size=1", "train.learning_rate=5e-3", "train.warmup_ratio=0.2",
          "train.loss_reduction=sample", "train.router_aux_loss_coef=0.01")


def common() -> list[str]:
    return [*COMMON, f"data.sources=[{kit.shared_mixed_jsonl()}]"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The tiny model and its processor saved as a pretrained folder."""
    folder = tmp_path_factory.mktemp(f"{RECIPE}_pretrained")
    recipe, cfg = kit.load_recipe(RECIPE), kit.compose_config(RECIPE)
    recipe.build_model(cfg.model, "sdpa").save_pretrained(folder)
    recipe.build_processor(cfg.model).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.launch
def test_experts_split_over_two_ranks_with_fsdp2_train_what_one_rank_accumulating_two_trains(pretrained, tmp_path):
    """From a pretrained folder, which rank 0 alone reads: each whole expert weight reaches the other rank before
    the split. DDP's path (the experts left out of its all-reduce, their gradients scaled by a hook) is the CP x EP
    run's below."""
    both = [*common(), f"model.pretrained={pretrained}"]
    split = [*both, "train.sharding=fsdp2", "train.expert_parallel_size=2", "train.gradient_accumulation_steps=1"]
    out = kit.train(RECIPE, tmp_path, [*split, "train.save_every_steps=1", "train.keep_last=100"], nproc=2).stdout
    assert "expert parallelism: 4 experts per layer split over 2 ranks (2 each)" in out, out
    two, one = check_against_one_rank(tmp_path, both)
    # resumed from the middle of the second epoch: the rest of the run, exactly
    step = [m["step"] for m in two if m["epoch"] == 1][0]
    resumed = tmp_path / "resumed"
    kit.train(RECIPE, resumed, [*split, f"train.resume_from={tmp_path / CHECKPOINTS / f'step_{step:08d}'}"], nproc=2)
    assert kit.read_metrics(resumed) == two[step:]
    assert kit.max_weight_difference(kit.final_weights(resumed), kit.final_weights(tmp_path)) == 0
    loads = [(a, b) for x, y in zip(two, one) for a, b in zip(x["expert_load"], y["expert_load"], strict=True)]
    assert max(abs(a - b) for a, b in loads) <= 1e-3  # rounded to 4 places


def check_against_one_rank(run_dir, both: list[str]) -> tuple[list[dict], list[dict]]:
    """``run_dir``'s run against 1 rank x accumulation 2 over ``both`` (the session's, shared by the tests here):
    the same samples per step, losses, aux losses and grad norms, final weights (the experts gathered); the two
    runs' metrics."""
    one_dir = kit.cached_run(RECIPE, [*both, "train.gradient_accumulation_steps=2"])
    split, one = kit.read_metrics(run_dir), kit.read_metrics(one_dir)
    assert [m["samples"] for m in split] == [m["samples"] for m in one] and len(split) >= 4
    differences = {key: max(abs(a[key] - b[key]) for a, b in zip(split, one)) for key in ("loss", "aux_loss",
                                                                                            "grad_norm")}
    weights = kit.max_weight_difference(kit.final_weights(run_dir), kit.final_weights(one_dir))
    print(f"{len(split)} steps: {differences}, weights {weights}")
    assert differences["loss"] <= 1e-5 and differences["aux_loss"] <= 1e-5 and differences["grad_norm"] <= 1e-4
    assert weights <= 1e-5, f"parameters differ by {weights}"
    return split, one


@pytest.mark.slow
@pytest.mark.launch
def test_cp2_by_ep2_on_four_ranks_with_fsdp2_trains_what_one_rank_accumulating_two_trains(pretrained, tmp_path):
    """DP 2 x CP 2 on 4 ranks, each EP group the CP group (ranks 0-1, 2-3), so each expert slice has 2 replicas
    (ranks 0 and 2, 1 and 3) whose FSDP2 shards reduce their gradients between them (force-summed on gloo; the 2-rank
    runs have one replica); the reference is the 2-rank FSDP2 test's."""
    both = [*common(), f"model.pretrained={pretrained}"]
    out = kit.train(RECIPE, tmp_path, [*both, "train.sharding=fsdp2", "train.context_parallel_size=2",
                                       "train.expert_parallel_size=2", "train.gradient_accumulation_steps=1"],
                    nproc=4).stdout
    assert "expert parallelism: 4 experts per layer split over 2 ranks (2 each), 2 replica(s)" in out, out
    summary = kit.read_summary(tmp_path)
    assert summary["context_parallel_size"] == 2 and summary["world_size"] == 4
    check_against_one_rank(tmp_path, both)


def _model(experts: int):
    module = SimpleNamespace(num_experts=experts, _is_expert_parallel=False)
    return SimpleNamespace(named_modules=lambda: [("layers.0.mlp.experts", module)])


def test_an_ep_size_that_does_not_divide_the_world_or_the_experts_or_a_model_without_experts_is_one_line():
    with pytest.raises(ConfigError, match=r"^train.expert_parallel_size=2 does not divide the 3 processes"):
        check_expert_parallel(2, 3, _model(4))
    with pytest.raises(ConfigError, match=r"^train.expert_parallel_size=3 does not divide the 4 experts of "
                                          r"layers.0.mlp.experts$"):
        check_expert_parallel(3, 3, _model(4))
    dense = kit.load_recipe("qwen3_5").build_model(kit.compose_config("qwen3_5").model, "sdpa")
    with pytest.raises(ConfigError, match=r"^train.expert_parallel_size=2 needs a mixture-of-experts model: "
                                          r"Qwen3_5ForConditionalGeneration has no experts$"):
        check_expert_parallel(2, 2, dense)
    check_expert_parallel(2, 4, _model(4))  # 2 replicas of each half


@pytest.mark.slow
@pytest.mark.launch
def test_experts_split_over_the_context_parallel_ranks_train_what_one_process_trains(tmp_path):
    """CP 2 x EP 2 on 2 processes under DDP, layers recomputed in backward: each row's tokens split over the two
    ranks (Ulysses) and each layer's experts too, the EP group being the CP group, the all-to-alls run again in the
    recomputation; against qwen3_5_moe's CP suite's 1-process reference (shared where both run in one session)."""
    print(kit.check_split_training(RECIPE, tmp_path, split=(2, 2), reference=(1, 1),
                                   overrides=("train.router_aux_loss_coef=0.01",),
                                   split_overrides=("train.expert_parallel_size=2",
                                                    "train.activation_checkpointing=true")))


def test_the_save_of_split_experts_writes_what_a_save_without_them_writes(tmp_path):
    """Qwen3-VL-MoE's experts carry a reverse weight conversion that transposes a saved tensor whose shape is not the
    model parameter's: saved against EP rank 0's slices (as a split run holds them, ``split_experts``), the whole
    weights came out transposed; inside ``saved_whole`` the file is the unsplit model's, tensor for tensor."""
    model = kit.load_recipe("qwen3_vl_moe").build_model(kit.compose_config("qwen3_vl_moe").model, "sdpa")
    whole = {name: t.detach().clone() for name, t in model.state_dict().items()}
    model.save_pretrained(tmp_path / "unsplit")
    for _, module in expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            setattr(module, name, torch.nn.Parameter(getattr(module, name).detach()[:module.num_experts // 2]))
        setattr(module, SPLIT_NAMES, ("gate_up_proj", "down_proj"))
    sliced = {name: model.get_parameter(name) for name in whole if ".experts." in name}
    model.save_pretrained(tmp_path / "sliced", state_dict=whole)
    with saved_whole(model, whole):
        model.save_pretrained(tmp_path / "whole", state_dict=whole)
    unsplit, bare, inside = (load_file(tmp_path / folder / "model.safetensors")
                             for folder in ("unsplit", "sliced", "whole"))
    assert any(bare[name].shape != unsplit[name].shape for name in sliced)  # the trap, as transformers 5.24 has it
    assert inside.keys() == unsplit.keys() and all(torch.equal(inside[k], unsplit[k]) for k in unsplit)
    assert all(model.get_parameter(name) is param for name, param in sliced.items())  # the slices are back
