"""Decoded frames -> the rows of patch values a grid-patch vision tower takes, with numpy (torchvision, which
transformers' video processors need for this, does not install beside this torch).

The layout (the one transformers' M-RoPE video processors share): frames rescaled and normalised, grouped
``temporal_patch_size`` frames at a time (the last frame repeated to fill the last group), cut into ``patch_size``
squares and flattened merge block by merge block: one row of ``C * temporal_patch_size * patch_size**2`` values per
patch, ``t * h * w`` rows per video, each ``merge_size**2`` consecutive rows one placeholder token. Which frames are
sampled and what size they are resized to is the model's (its recipe's video processor).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def normalize_frames(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(T, H, W, C)`` uint8 -> ``(T, C, H, W)`` float32, rescaled to [0, 1] and normalised by ``mean`` / ``std``."""
    values = (pixels.astype(np.float64) / 255.0).astype(np.float32)
    values = (values - np.float32(mean)) / np.float32(std)
    return values.transpose(0, 3, 1, 2)


def patchify(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """``(T, C, H, W)`` -> ``(t * h * w, C * temporal_patch_size * patch_size**2)``, merge block by merge block."""
    step, patch, merge = temporal_patch_size, patch_size, merge_size
    if pad := -len(frames) % step:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    count, channels, height, width = frames.shape
    t, h, w = count // step, height // patch, width // patch
    blocks = frames.reshape(t, step, channels, h // merge, merge, patch, w // merge, merge, patch)
    return blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, channels * step * patch * patch)
