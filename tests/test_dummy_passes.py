"""Every media parameter takes part in every backward: a micro-batch runs a dummy pass per media encoder it leaves
unused (kinds declared on one tower share it). Under FSDP2 every micro-batch runs the encoder once per media kind
the model takes, real or dummy: an image-only rank beside an image-and-video rank would otherwise gather the vision
blocks once where the other gathers them twice (a gloo size mismatch on the Qwen3-VL demo with clips, 2 ranks)."""

from __future__ import annotations

import pytest
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
    encoder = recipe.build_encoder(recipe.build_processor(kit.compose_config("qwen3_vl").model))
    assert media_kinds(model, encoder) == (IMAGES, VIDEOS.on_tower_of(IMAGES))  # its recipe feeds clips
    assert media_kinds(kit.load_recipe("llava").build_model(kit.compose_config("llava").model, "sdpa")) == (IMAGES,)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[1, 2, 3]])
    try:
        _, loss = forward_with_media_pass(model, {"input_ids": ids, "use_cache": False}, recipe.dummy_media(model), 2)
    finally:
        hook.remove()
    assert len(calls) == 2 and float(loss) == 0.0


def reached(model, outputs) -> set[str]:
    """The parameters a backward from ``outputs``' pooled features gives a gradient."""
    model.zero_grad(set_to_none=True)
    sum(t.sum() for t in outputs.pooler_output).backward()
    return {name for name, param in model.named_parameters() if param.grad is not None}


def test_gemma4_feeds_no_video_and_its_video_path_has_no_parameter_of_its_own():
    """Gemma 4's model takes video (``Gemma4Model.get_video_features``) but its recipe feeds none: the fed kinds
    decide, so a micro-batch runs no dummy video pass, and needs none: every parameter the video path reaches, the
    image path (the dummy pass) reaches too, so every trainable parameter still takes part in every backward."""
    recipe = kit.load_recipe("gemma4")
    cfg = kit.compose_config("gemma4").model
    model = recipe.build_model(cfg, "sdpa")
    encoder = recipe.build_encoder(recipe.build_processor(cfg))
    assert encoder.media_names == ("image",)
    assert media_kinds(model.model) == (IMAGES, VIDEOS)  # what the model could encode
    # the encoder's image kind: the kit's, with Gemma 4's patch positions (handed to the tower with each CP share)
    assert media_kinds(model.model, encoder) == media_kinds(model, encoder) == (encoder.image_kind,)
    assert [dummy_passes(batch, media_kinds(model, encoder)) for batch in ({}, {IMAGES.patch_key: torch.ones(1, 3)})] \
        == [1, 0]
    dummy = recipe.dummy_media(model)

    image = reached(model, model.model.get_image_features(**dummy))
    video = reached(model, model.model.get_video_features(pixel_values_videos=dummy["pixel_values"],
                                                   video_position_ids=dummy["image_position_ids"],
                                                   num_frames_per_video=torch.tensor([1])))
    assert video and video <= image


SHARED = (IMAGES, VIDEOS.on_tower_of(IMAGES))  # clips through the image tower (the Qwen families', GLM-4.1V's)


def test_kinds_on_one_tower_need_one_dummy_pass_between_them_but_one_per_kind_under_fsdp2():
    images, videos = {IMAGES.patch_key: torch.ones(4, 3)}, {VIDEOS.patch_key: torch.ones(8, 3)}
    batches = ({}, images, videos, {**images, **videos})
    assert [dummy_passes(batch, SHARED) for batch in batches] == [1, 0, 0, 0]
    # FSDP2: every pass gathers the tower's blocks, so every rank runs it once per kind (the module docstring)
    assert [dummy_passes(batch, SHARED, per_kind=True) for batch in batches] == [2, 1, 1, 0]
    assert [dummy_passes(batch, (IMAGES, VIDEOS)) for batch in batches] == [2, 1, 1, 0]  # two towers: as before


def test_qwen2_vl_runs_no_dummy_video_pass_beside_images_and_one_pass_for_text():
    """Qwen2-VL's clips run through its image tower: a micro-batch with images and no clip runs no dummy pass (it
    ran one for videos before), a text-only one a single pass (two before)."""
    recipe, cfg = kit.load_recipe("qwen2_vl"), kit.compose_config("qwen2_vl").model
    model = recipe.build_model(cfg, "sdpa")
    kinds = media_kinds(model, recipe.build_encoder(recipe.build_processor(cfg)))
    assert [kind.tower_name for kind in kinds] == ["image", "image"]
    dummy = recipe.dummy_media(model)
    assert [dummy_passes(batch, kinds) for batch in ({IMAGES.patch_key: dummy["pixel_values"]}, {})] == [0, 1]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v"])
def test_a_video_kind_on_the_image_tower_reaches_no_parameter_the_image_path_does_not(name):
    """What makes the shared tower's one pass exact: every parameter a clip's pass gives a gradient, an image's
    pass (a real one, or the dummy) gives one too, so no parameter leaves a backward when the video pass is left
    out."""
    recipe, cfg = kit.load_recipe(name), kit.compose_config(name).model
    model = recipe.build_model(cfg, "sdpa")
    kinds = {kind.name: kind for kind in media_kinds(model, recipe.build_encoder(recipe.build_processor(cfg)))}
    assert kinds["video"].tower_name == kinds["image"].tower_name
    dummy = recipe.dummy_media(model)

    image = reached(model, model.model.get_image_features(**dummy))
    video = reached(model, model.model.get_video_features(pixel_values_videos=dummy["pixel_values"],
                                                   video_grid_thw=dummy["image_grid_thw"]))
    assert video and video <= image
