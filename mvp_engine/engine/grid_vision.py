"""What the engine needs from a grid-patch vision tower (media as rows of flattened ``temporal_patch_size x
patch_size**2`` patches with a ``(t, h, w)`` grid per item, ``spatial_merge_size**2`` patches merged into one media
token: Qwen2-VL's tower and the families built on it, e.g. GLM-4.1V's), read from ``config.vision_config`` so no
recipe writes it twice: the dummy image of the zero-weighted media pass and the cost profile."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mvp_engine.kit.mllm.data import CostProfile
from mvp_engine.kit.mllm.data.media import IMAGES
from mvp_engine.packing import unwrap_model

from . import flops


def grid_dummy_media(model) -> dict:
    """``get_image_features`` kwargs for the smallest image the tower takes: one merged token (a
    ``spatial_merge_size`` square of patches), zero pixels. Run zero-weighted on image-free micro-batches."""
    vision = unwrap_model(model).config.vision_config
    merge = vision.spatial_merge_size
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {IMAGES.patch_key: torch.zeros(merge * merge, patch_values),
            IMAGES.grid_key: torch.tensor([[1, merge, merge]])}


def grid_cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = (), *,
                      parts: flops.VisionParts) -> CostProfile:
    """The engine's cost profile (:func:`flops.cost_profile`) of a grid-patch vision side whose tower and projector
    sit where ``parts`` (the recipe's) says: one media token per ``spatial_merge_size`` square of patches."""
    merge = int(unwrap_model(model).config.vision_config.spatial_merge_size)
    return flops.cost_profile(model, unreachable, parts, patches_per_media_token=merge * merge)
