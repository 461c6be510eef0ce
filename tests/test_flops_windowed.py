"""The cost model on sliding windows and bidirectional blocks: tiny Gemma 3 models built from transformers configs.

Why: Gemma's sliding-window layers need only the pairs inside their window, and its image tokens attend to each
other both ways; counting every layer as full causal attention misstates MFU and ``packing.balance=compute``. Checked
here, on packed rows whose segments are longer than the window and hold one or two images: executed FLOPs on eager
against ``FlopCounterMode`` (forward and forward + backward), the useful pairs against the allowed pairs of the very
masks the model is given, the executed pairs of sdpa_varlen and flex against the per-span masks and the BlockMask
their forms build, and the planner's per-pack cost from metadata against the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

from mvp_engine.engine.flops import batch_flops, cost_profile
from mvp_engine.engine.loss import weighted_token_loss
from mvp_engine.kit.mllm.data.cost import FLEX_BLOCK, causal_pairs, pack_units, windowed_pairs
from mvp_engine.packing import block_mask, causal, dense_mask, layer_masks, same_block, sliding_window, span_masks
from recipes.gemma3.model import cost_profile as gemma3_cost_profile

TOLERANCE = 0.05
WINDOW = 6
IMAGE, BOI, EOI = 60, 61, 62
TOKENS_PER_IMAGE = 4

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, sliding_window=WINDOW, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, num_channels=3, vision_use_head=False)  # as the released checkpoints


def _model(vlm: bool):
    torch.manual_seed(0)
    if vlm:
        config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=TOKENS_PER_IMAGE,
                              image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
        return Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").train()
    return Gemma3ForCausalLM._from_config(Gemma3TextConfig(**TEXT), attn_implementation="eager").train()


def _image() -> list[int]:
    return [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI]


def _batch(vlm: bool) -> tuple[dict, list[list[list[int]]]]:
    """Two rows ending in padding; segments longer than the window, one with two images, one text only."""
    image = _image() if vlm else [7] * (TOKENS_PER_IMAGE + 2)
    rows = [[[2, 5] + image + [9, 10, 11], [2] + list(range(20, 28))],
            [[2, 3] + image + [4] + image + [5, 6]]]
    width = 24
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    positions = torch.arange(width).repeat(len(rows), 1)
    for r, row in enumerate(rows):
        at = 0
        for s, sample in enumerate(row):
            ids[r, at:at + len(sample)] = torch.tensor(sample)
            segments[r, at:at + len(sample)] = s
            positions[r, at:at + len(sample)] = torch.arange(len(sample))
            at += len(sample)
        positions[r, at:] = torch.arange(width - at)
    labels = torch.where(segments >= 0, ids, -100)
    labels[:, 0] = -100
    batch = {"input_ids": ids, "labels": labels, "pack_segment_ids": segments, "position_ids": positions,
             "token_type_ids": (ids == IMAGE).long(), "media_tokens": (ids == IMAGE).sum(-1)}
    if vlm:
        batch["pixel_values"] = torch.randn(int((ids == BOI).sum()), 3, 16, 16)
    return batch, rows


def _profile(model, vlm: bool):
    if not vlm:
        return cost_profile(model)
    # the Gemma 3 recipe's reading of the vision side, the blocks in both layer types as this test's masks have them
    return dataclasses.replace(gemma3_cost_profile(model), block_field="token_type_ids", block_values=(1,),
                               full_blocks=True, sliding_blocks=True)


def _predicates(batch: dict, vlm: bool) -> dict:
    core = causal() | same_block(torch.where(batch["token_type_ids"] == 1, 0, -1)) if vlm else causal()
    return {"full_attention": core, "sliding_attention": sliding_window(WINDOW) & core}


def _model_kwargs(batch: dict, vlm: bool, backend: str) -> dict:
    masks = layer_masks(batch["pack_segment_ids"], _predicates(batch, vlm), backend, torch.float32)
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": masks,
              "use_cache": False}
    if vlm:
        kwargs.update(pixel_values=batch["pixel_values"], token_type_ids=batch["token_type_ids"])
    return kwargs


@pytest.mark.parametrize("vlm", [False, True], ids=["text", "vlm"])
def test_eager_flops_match_the_flop_counter(vlm):
    model = _model(vlm)
    batch, _ = _batch(vlm)
    profile = _profile(model, vlm)
    assert profile.sliding_window == WINDOW and profile.lm_sliding_pair.forward == 3 * profile.lm_pair.forward
    ours = batch_flops(profile, batch, "eager")
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(**_model_kwargs(batch, vlm, "eager")).logits
        counted_forward = counter.get_total_flops()
        part = weighted_token_loss(logits, batch["labels"], batch["pack_segment_ids"], "token")
        (part.weighted_sum / part.weight_total).backward()
    forward = sum(p["forward"] for p in profile.breakdown(ours.executed_units).values())
    print(f"executed {ours.executed:,} vs counter {counter.get_total_flops():,}; forward {forward:,} vs "
          f"{counted_forward:,}; useful {ours.useful:,}")
    assert abs(forward / counted_forward - 1) <= TOLERANCE
    assert abs(ours.executed / counter.get_total_flops() - 1) <= TOLERANCE
    assert ours.useful < ours.executed


def _allowed(mask: torch.Tensor, segments: torch.Tensor) -> int:
    real = segments >= 0
    return int((mask[:, 0] & real[:, :, None] & real[:, None, :]).sum())


@pytest.mark.parametrize("vlm", [False, True], ids=["text", "vlm"])
def test_useful_pairs_are_the_allowed_pairs_of_the_masks_the_model_gets(vlm):
    batch, rows = _batch(vlm)
    profile = _profile(_model(vlm), vlm)
    useful = batch_flops(profile, batch, "eager").useful_units
    predicates = _predicates(batch, vlm)
    segments = batch["pack_segment_ids"]
    assert useful.lm_pairs == _allowed(dense_mask(segments, predicates["full_attention"]), segments)
    assert useful.lm_sliding_pairs == _allowed(dense_mask(segments, predicates["sliding_attention"]), segments)
    lengths = [len(s) for row in rows for s in row]
    assert useful.lm_sliding_pairs < useful.lm_pairs  # segments longer than the window cost less in sliding layers
    blocks = 3 * TOKENS_PER_IMAGE * (TOKENS_PER_IMAGE - 1) // 2 if vlm else 0
    assert useful.lm_pairs == causal_pairs(lengths) + blocks
    assert useful.lm_sliding_pairs == windowed_pairs(lengths, WINDOW) + blocks
    # the planner, from lengths and media columns only (each image's tokens squared), counts the same
    media = [sample.count(IMAGE) for row in rows for sample in row] if vlm else [0] * len(lengths)
    planned = pack_units(lengths, media, [TOKENS_PER_IMAGE * m for m in media], [m // TOKENS_PER_IMAGE for m in media],
                         profile)
    assert (planned.lm_pairs, planned.lm_sliding_pairs) == (useful.lm_pairs, useful.lm_sliding_pairs)


def test_varlen_and_flex_count_what_their_mask_forms_compute():
    """sdpa_varlen runs masked sdpa (n^2) on a span with a mask of its own and the causal kernel on the others; flex
    computes the tiles its BlockMask keeps. Rows long enough for several tiles, a window cutting inside samples."""
    torch.manual_seed(0)
    width, window = 700, 150
    segments = torch.full((2, width), -1, dtype=torch.long)
    segments[0, :300], segments[0, 300:420], segments[0, 420:650] = 0, 1, 2
    segments[1, :100], segments[1, 100:700] = 0, 1
    types = torch.zeros(2, width, dtype=torch.long)
    types[0, 10:74] = types[0, 440:470] = types[1, 200:460] = 1
    batch = {"pack_segment_ids": segments, "token_type_ids": types, "media_tokens": types.sum(-1)}
    profile = dataclasses.replace(cost_profile(_model(False)), sliding_window=window, block_field="token_type_ids",
                                  block_values=(1,), full_blocks=False, sliding_blocks=True)
    core = causal() | same_block(torch.where(types == 1, 0, -1))
    predicates = {"lm_pairs": causal(), "lm_sliding_pairs": sliding_window(window) & core}
    varlen = batch_flops(profile, batch, "sdpa_varlen").executed_units
    flex = batch_flops(profile, batch, "flex_attention").executed_units
    for units, predicate in predicates.items():
        spans = span_masks(segments, predicate)
        sizes = np.diff(spans.cu_seq_lens.numpy())
        expected = sum(n * n if mask is not None else n * (n + 1) // 2 for n, mask in zip(sizes, spans.masks))
        assert getattr(varlen, units) == expected, units
        blocks = block_mask(segments, predicate, FLEX_BLOCK)
        tiles = int(blocks.kv_num_blocks.sum()) + int(blocks.full_kv_num_blocks.sum())
        assert getattr(flex, units) == tiles * FLEX_BLOCK * FLEX_BLOCK, units
    dense = batch_flops(profile, batch, "sdpa").executed_units
    assert dense.lm_pairs == dense.lm_sliding_pairs == 2 * width * width
    assert flex.lm_sliding_pairs < flex.lm_pairs < dense.lm_pairs
