"""tools/plan_memory.py and engine/memory_plan.py: the activation and loss terms against bytes counted from tensors.

Checked on the CPU, fp32, on one packed micro-batch with images of the demo set: what the plan says a forward and its
loss keep for the backward is within 10 % of what ``recompute.SavedForBackward`` counts (every storage once) for
Qwen2.5-VL (RMSNorm with an fp32 upcast, gated MLPs, a windowed vision tower with a conv patch embedding and a
merger) and Gemma 3 (sandwich norms, q/k norms, a SigLIP tower with LayerNorm and a plain MLP, a pooling
projector): full loss without recomputation, chunked loss with it. The command prints a verdict and, when the run
does not fit, a lever.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mvp_engine.engine import memory_plan
from mvp_engine.engine.config import compose_config, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.flops import recipe_cost_profile
from mvp_engine.engine.linear_loss import HeadInputs
from mvp_engine.engine.loss import shifted_targets, weighted_token_loss
from mvp_engine.engine.participation import dummy_passes, forward_with_media_pass, freeze_parameters, media_kinds
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.recompute import SavedForBackward, enable_activation_checkpointing
from mvp_engine.engine.run_data import build_run_dataset
from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMCollator
from tools import plan_memory

LENGTH = 1024
TOLERANCE = 0.10


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3"])
def case(request, tmp_path_factory):
    """The recipe, its model config and specs, and its fullest packed micro-batch of LENGTH tokens."""
    name = request.param
    recipe = load_recipe(name)
    cfg = with_demo_data(compose_config(name, ["+packing=greedy", f"data.max_seq_len={LENGTH}",
                                               "demo.num_samples=24",
                                               f"demo.out_dir={tmp_path_factory.mktemp('demo')}"]))
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    processor = recipe.build_processor(model_cfg)
    dataset = build_run_dataset(specs, recipe.build_encoder(processor), None)
    plan = dataset.plan(0)
    pack = max(plan.packs, key=lambda p: sum(plan.lengths[i] for i in p))
    batch = MLLMCollator(recipe.pad_token_id(processor), LENGTH)([dataset.encode_pack(pack)])
    batch.pop("bad_records", None)
    return recipe, model_cfg, specs.attention, batch


def counted_and_planned(case, loss_impl: str, recompute: bool) -> tuple[int, float]:
    """Bytes the forward and loss keep for the backward, counted, and as the plan has them."""
    recipe, model_cfg, attention, batch = case
    model = recipe.build_model(model_cfg, attention)
    freeze_parameters(model, [], recipe.unreachable_parameters(model))
    if recompute:
        enable_activation_checkpointing(model)
    model.train()
    head = HeadInputs(model)
    with SavedForBackward(model) as saved:
        with head if loss_impl == "chunked" else torch.enable_grad():
            outputs, _ = forward_with_media_pass(model, recipe.prepare_packed(batch, model, attention),
                                                 recipe.dummy_media(model), dummy_passes(batch, media_kinds(model)))
        if loss_impl == "chunked":
            head.loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token")
        else:
            weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token")
        counted = saved.bytes
    tokens = batch["input_ids"].numel()
    media = int(batch["media_tokens"].sum())
    supervised = int((shifted_targets(batch["labels"]) != IGNORE_INDEX).sum())
    profile = recipe_cost_profile(recipe, model)
    per_media = (profile.item_patches / model.config.mm_tokens_per_image if profile.item_patches
                 else profile.patches_per_media_token)
    shape = memory_plan.model_shape(model, torch.float32)
    kept, _ = memory_plan.activation_bytes(shape, tokens, media, int(media * per_media), recompute, 4)
    loss_kept, _ = memory_plan.loss_bytes(shape, tokens, supervised, loss_impl, 512, 4)
    return counted, kept + loss_kept


@pytest.mark.parametrize(("loss_impl", "recompute"), [("full", False), ("chunked", True)])
def test_planned_activations_and_loss_are_within_ten_percent_of_counted_bytes(case, loss_impl, recompute):
    counted, planned = counted_and_planned(case, loss_impl, recompute)
    assert abs(planned - counted) <= TOLERANCE * counted, (planned, counted)


def test_the_chunked_loss_keeps_less_than_the_full_one_and_levers_lower_the_total():
    shape = memory_plan.ModelShape(trainable=10**9, parameters=10**9, vocab=151936, hidden=4096, largest_unit=10**8,
                                   language=memory_plan.BlockGroup(32, 4096, 200_000.0))
    base = memory_plan.Settings(world_size=8, sharding="none", loss_impl="full", length=32768)
    full = memory_plan.plan(shape, base)
    chunked = memory_plan.plan(shape, memory_plan.Settings(**{**base.__dict__, "loss_impl": "chunked"}))
    assert full.loss > 20 * chunked.loss
    for change in ({"sharding": "fsdp2"}, {"recompute": True}, {"cp": 2}, {"sharding": "fsdp2", "offload": "params"},
                   {"offload": "optimizer"}):
        assert memory_plan.plan(shape, memory_plan.Settings(**{**base.__dict__, **change})).total < full.total, change


def test_the_command_says_whether_it_fits_and_names_a_lever(capsys):
    tiny = ["--recipe", "qwen2_5_vl", "--world-size", "2", "--length", "4096", "--loss-impl", "full"]
    fits = plan_memory.main([*tiny, "--gpu-gib", "80"])
    assert fits["fits"] and "fits" in capsys.readouterr().out
    tight = plan_memory.main([*tiny, "--gpu-gib", "0.05", "--levers"])
    out = capsys.readouterr().out
    assert not tight["fits"] and "does not fit" in out and "next lever: " in out
    assert tight["levers"]["train.loss_impl=chunked"] < tight["plan"]["total"]
