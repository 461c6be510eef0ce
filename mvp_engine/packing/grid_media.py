"""The media inputs of a grid-patch vision tower: per media kind, rows of flattened patches (``patch_key``) and one
``(t, h, w)`` grid per item (``grid_key``), plus the kind's per-item fields. Qwen2-VL's tower lays media out this
way, and so do the families built on it (GLM-4.1V), so each recipe names its media kinds and nothing else.

Why here: checking that the rows hold the patches the grids need is what every such recipe's step and collator do
before the tower sees them; the collator does it once on the CPU (:func:`grid_metadata`), so the step skips it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import MediaKind

from .segment_rope import rope_metadata


def grid_media_kwargs(batch: Mapping[str, Any], kinds: Iterable[MediaKind], checked: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Pixels and grids of the batch's items of each of ``kinds``, each checked to hold the patches its grids need
    (unless the collator ``checked`` them), and the per-item fields the batch carries for the kind (e.g. a clip's
    seconds per temporal patch, which a model's M-RoPE reads)."""
    kwargs = {}
    for kind in kinds:
        grids = batch.get(kind.grid_key)
        if grids is None or grids.shape[0] == 0:
            continue
        pixels = batch[kind.patch_key]
        if not checked and pixels.shape[0] != (needed := int(grids.prod(-1).sum())):
            raise ValueError(f"{kind.patch_key} has {pixels.shape[0]} patches, {kind.grid_key} needs {needed}")
        kwargs.update({kind.patch_key: pixels, kind.grid_key: grids})
        kwargs.update({key: batch[key] for key in kind.item_keys if batch.get(key) is not None})
    return kwargs


def grid_metadata(batch: Mapping[str, Any], positions: Callable[[Mapping[str, Any]], torch.Tensor],
                  kinds: Iterable[MediaKind]) -> dict[str, Any]:
    """A packed batch's metadata, on the CPU where it is collated: its layout, its media of ``kinds`` checked
    against their grids, and its multimodal-RoPE ``positions`` (:func:`rope_metadata`)."""
    grid_media_kwargs(batch, kinds)
    return rope_metadata(batch, positions)
