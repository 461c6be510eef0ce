"""Every micro-batch runs the media encoder once per media kind the model takes, real or dummy: under FSDP2 an
image-only rank beside an image-and-video rank would otherwise gather the vision blocks once where the other
gathers them twice (a gloo size mismatch on the Qwen3-VL demo with clips, 2 ranks)."""

from __future__ import annotations

import torch

import mvp_engine.engine.testing as kit
from mvp_engine.engine.participation import dummy_passes, forward_with_media_pass, media_kinds
from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS


def test_a_pass_per_missing_kind():
    images, videos = {IMAGES.patch_key: torch.ones(4, 3)}, {VIDEOS.patch_key: torch.ones(8, 3)}
    both = (IMAGES, VIDEOS)
    assert [dummy_passes(batch, both) for batch in ({}, images, videos, {**images, **videos})] == [2, 1, 1, 0]
    assert dummy_passes({IMAGES.patch_key: torch.ones(0, 3)}, both) == 2  # an empty tensor holds no media
    assert [dummy_passes(batch, (IMAGES,)) for batch in ({}, images)] == [1, 0]


def test_the_encoder_runs_as_often_whatever_the_micro_batch_holds():
    """Qwen3-VL takes images and videos: a text-only micro-batch runs its vision tower twice, as one with both."""
    recipe = kit.load_recipe("qwen3_vl")
    model = recipe.build_model(kit.compose_config("qwen3_vl").model, "sdpa")
    assert media_kinds(model) == (IMAGES, VIDEOS)
    assert media_kinds(kit.load_recipe("llava").build_model(kit.compose_config("llava").model, "sdpa")) == (IMAGES,)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[1, 2, 3]])
    try:
        _, loss = forward_with_media_pass(model, {"input_ids": ids, "use_cache": False}, recipe.dummy_media(model), 2)
    finally:
        hook.remove()
    assert len(calls) == 2 and float(loss) == 0.0
