"""The cost model: FLOPs counted from a model's shapes agree with torch's FLOP counter, and with the planner.

Why: MFU, the per-step TFLOP/s and ``packing.balance=compute`` all rest on ``mvp_engine.engine.flops``. Checked here:
every recipe's tiny model on a packed micro-batch with media (eager: the backend the counter can see), executed FLOPs
within 5 % of ``FlopCounterMode`` (forward and total); a frozen tower changes the backward as the counter says; the
planner's per-pack cost from metadata alone equals the useful FLOPs of the encoded pack; the attention pair counts
per backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mvp_engine.engine.flops import GPU_PEAK_TFLOPS, batch_flops, device_peak_tflops, recipe_cost_profile
from mvp_engine.engine.testing import collate_rows, equivalence_case
from mvp_engine.engine.testkit.flops import check_flop_count
from mvp_engine.kit.mllm.data import CostProfile, Rate, WorkUnits, pack_costs
from mvp_engine.kit.mllm.data.cost import attention_pairs, causal_pairs, pack_units
from mvp_engine.packing import packed_inputs

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.parent.name for p in (REPO_ROOT / "recipes").glob("*/train.py"))
TOLERANCE = 0.05


@pytest.mark.parametrize("name", RECIPES)
def test_executed_flops_match_the_flop_counter_on_every_recipe(name, tmp_path):
    check = check_flop_count(name, tmp_path)
    print(check.line())
    assert abs(check.relative_error) <= TOLERANCE, check.line()
    assert abs(check.forward_relative_error) <= TOLERANCE, check.line()
    assert check.useful < check.executed, "the rows end in padding: the dense eager mask executes more than needed"
    assert check.planning_profile_matches, "the meta-device profile (planning, reports) differs from the trainer's"


def test_frozen_towers_cost_what_the_counter_says(tmp_path):
    """LLaVA stage 1 (only the projector trains): no weight gradients in the vision tower or the language model,
    but the gradient still flows back through the language model to the projector."""
    frozen = check_flop_count("llava", tmp_path, ("model.vision_tower", "model.language_model", "lm_head"))
    full = check_flop_count("llava", tmp_path / "full")
    print(frozen.line())
    assert abs(frozen.relative_error) <= TOLERANCE, frozen.line()
    assert frozen.counted_forward == full.counted_forward and frozen.counted < full.counted
    assert frozen.planning_profile_matches


def test_lora_adapters_on_a_frozen_base_cost_what_the_counter_says(tmp_path):
    """LoRA on every linear layer of the language model, the vision tower and the projector (``model``): the
    adapters add their forward, the frozen base weights compute no weight gradient, and of the head kept in full
    (``modules_to_save``) only the trained copy runs."""
    lora = check_flop_count("llava", tmp_path, lora={"r": 4, "target_modules": ["model"],
                                                     "modules_to_save": ["lm_head"]})
    full = check_flop_count("llava", tmp_path / "full")
    print(lora.line())
    assert abs(lora.relative_error) <= TOLERANCE and abs(lora.forward_relative_error) <= TOLERANCE, lora.line()
    assert lora.counted_forward > full.counted_forward
    assert lora.counted - lora.counted_forward < full.counted - full.counted_forward
    assert lora.planning_profile_matches


@pytest.mark.parametrize("name", RECIPES)
def test_pack_cost_from_metadata_equals_the_useful_flops_of_the_encoded_pack(name, tmp_path):
    """What the planner balances (lengths and media columns only) is what the step needs: images, and a video where
    the recipe takes video (its attention groups: one per temporal patch)."""
    case = equivalence_case(name, tmp_path)
    model = case.recipe.build_model(case.model_cfg, "eager")
    profile = recipe_cost_profile(case.recipe, model)
    metas = [s.meta for s in case.samples]
    videos = any(s.media.get("video_grid_thw") is not None for s in case.samples)
    encoder = case.recipe.build_encoder(case.processor)
    assert videos == bool(getattr(encoder, "video_token", None)), "the case holds a video iff the recipe takes one"
    column = {name: np.array([getattr(m, name) for m in metas]) for name in
              ("length", "media_tokens", "media_sq", "num_media")}
    packs = [list(range(3)), list(range(3, len(case.samples)))]
    offsets = np.array([0, 3, len(case.samples)])
    planned = pack_costs(profile, offsets, np.arange(len(case.samples)), column["length"], column["media_tokens"],
                         column["media_sq"], column["num_media"])
    for pack, cost in zip(packs, planned):
        row = collate_rows([[case.samples[i] for i in pack]], case.pad_token_id)
        assert batch_flops(profile, row, "sdpa_varlen").useful == cost
        units = pack_units(column["length"][pack], column["media_tokens"][pack], column["media_sq"][pack],
                           column["num_media"][pack], profile)
        assert profile.flops(units) == cost


def test_attention_pairs_per_backend():
    rows = [[(3, True), (2, True), (3, False)], [(8, True)]]

    def pairs(backend, spans=rows, width=8):
        return attention_pairs(packed_inputs(backend), spans, width)

    assert pairs("eager") == pairs("sdpa") == pairs("some_future_backend") == 2 * 64  # unknown: counted dense
    assert pairs("sdpa_varlen") == 6 + 3 + 6 + 36  # causal per span, padding runs included
    assert pairs("flash_attention_2") == pairs("flash_attention_3") == 51
    assert pairs("flex_attention") == 2 * 128 * 128  # one tile per row
    assert pairs("flex_attention", [[(200, True), (100, True)]], 300) == 5 * 128 * 128  # tiles 00 10 11 21 22
    assert causal_pairs([3, 2]) == 9


def test_profile_arithmetic():
    profile = CostProfile(lm_token=Rate(10, 20), lm_pair=Rate(1, 2), vision_patch=Rate(5, 0),
                          vision_position=Rate(3, 6), vision_pair=Rate(1, 1), projector_token=Rate(7, 14),
                          patches_per_media_token=4, extra_positions_per_item=0)
    units = profile.media_units(media_tokens=8, media_sq=32, num_media=1)  # one clip: 2 groups of 4 tokens
    assert units == WorkUnits(vision_patches=32, vision_positions=32, vision_pairs=16 * 32, media_tokens=8)
    units.lm_tokens, units.lm_pairs = 20, 210
    assert profile.flops(units) == 20 * 30 + 210 * 3 + 32 * 5 + 32 * 9 + 512 * 2 + 8 * 21
    assert CostProfile.from_dict(profile.to_dict()) == profile
    cls = CostProfile(vision_pair=Rate(1, 0), extra_positions_per_item=1)
    assert cls.media_units(16, 256, 1).vision_pairs == 17 * 17  # CLS: 16 patches + 1 position, attended together


def test_peak_comes_from_the_config_then_the_table():
    import torch

    assert device_peak_tflops(123.0, "no", torch.device("cpu")) == (123.0, "train.peak_tflops")
    assert device_peak_tflops(None, "bf16", torch.device("cpu"))[0] is None
    names = [name for name, _ in GPU_PEAK_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100") and names.index("L40S") < names.index("L4")
