"""Decoded frames -> the rows of patch values a grid-patch vision tower takes, with numpy (torchvision, which
transformers' video processors need for this, does not install beside this torch).

The layout (the one transformers' M-RoPE video processors share): frames rescaled and normalised, grouped
``temporal_patch_size`` frames at a time (the last frame repeated to fill the last group), cut into ``patch_size``
squares and flattened merge block by merge block: one row of ``C * temporal_patch_size * patch_size**2`` values per
patch, ``t * h * w`` rows per video, each ``merge_size**2`` consecutive rows one placeholder token. Which frames are
sampled and what size they are resized to is the model's: its recipe's subclass of
:class:`GridPatchVideoProcessor`, which holds the rest (grids, token counts, decoding, the config file).
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image

from .media import VIDEOS
from .video import VideoInfo, load_video_frames

CONFIG_NAME = "video_preprocessor_config.json"  # transformers' file name and keys, so real checkpoints read too
# OpenAI CLIP's normalisation (transformers' OPENAI_CLIP_MEAN / _STD), the grid-patch towers' usual one
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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


@dataclass(frozen=True)
class GridPatchVideoProcessor(ABC):
    """A grid-patch tower's videos: ``frame_indices`` (which frames) and ``frame_size`` (what size) are the
    model's, a subclass's; the grid, the token count, the decoding and the layout are here. Every field is a plain
    number, so the ``repr`` states everything a video's token count depends on (the measure cache keys on it).
    ``video_processor_type`` is the class name transformers writes into the config file. The defaults are the
    layout's usual ones (Qwen2-VL's: 14-pixel patches, 2 x 2 merge, 2-frame temporal patches, CLIP's mean and
    std); a recipe's processor takes the patch sizes, mean and std of its image processor anyway
    (``builders.grid_video_processor``)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    fps: float = 2.0
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    video_processor_type: ClassVar[str]

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in ("image_mean", "image_std") and not value > 0:
                raise ValueError(f"video processor {field.name}={value!r} is invalid: allowed a positive number")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"video processor min/max are inverted: pixels {self.min_pixels}..{self.max_pixels}")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **defaults) -> GridPatchVideoProcessor:
        """The settings a checkpoint saved (``video_preprocessor_config.json``), else ``defaults``."""
        processor = cls(**defaults)
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            return processor
        saved = json.loads(path.read_text())
        size = saved.get("size") or {}
        saved.update(min_pixels=size.get("shortest_edge", saved.get("min_pixels")),
                     max_pixels=size.get("longest_edge", saved.get("max_pixels")))
        given = {f.name: saved[f.name] for f in fields(cls) if saved.get(f.name) is not None}
        return replace(processor, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("min_pixels", "max_pixels")}
        settings.update(size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                        do_sample_frames=True, video_processor_type=self.video_processor_type)
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    @abstractmethod
    def frame_indices(self, info: VideoInfo) -> list[int]:
        """The frames sampled from the video, in order (the model's sampling)."""

    @abstractmethod
    def frame_size(self, info: VideoInfo) -> tuple[int, int]:
        """``(height, width)`` every sampled frame is resized to (the model's resize rule)."""

    def grid_thw(self, info: VideoInfo) -> tuple[int, int, int]:
        height, width = self.frame_size(info)
        frames = len(self.frame_indices(info))
        return -(-frames // self.temporal_patch_size), height // self.patch_size, width // self.patch_size

    def token_count(self, info: VideoInfo) -> int:
        """Placeholder tokens of the video, from metadata alone."""
        return math.prod(self.grid_thw(info)) // self.merge_size**2

    def seconds_per_grid(self, info: VideoInfo) -> float:
        """Seconds one temporal patch spans, from metadata alone: ``temporal_patch_size`` over the sampled rate
        (transformers' ``VideoMetadata.sampled_fps``; Qwen2.5-VL's ``second_per_grid_ts``, which its M-RoPE
        multiplies into the clip's temporal positions)."""
        sampled_fps = len(self.frame_indices(info)) / info.num_frames * info.fps
        return self.temporal_patch_size / sampled_fps

    def __call__(self, videos: list[VideoInfo]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``pixel_values_videos`` (patches of every video, in order), ``video_grid_thw`` and each video's token
        count; the frames are decoded here."""
        patches, grids = [], []
        for info in videos:
            height, width = self.frame_size(info)
            frames = load_video_frames(info, self.frame_indices(info))
            pixels = np.stack([np.asarray(frame.resize((width, height), Image.Resampling.BICUBIC)) for frame in frames])
            values = normalize_frames(pixels, self.image_mean, self.image_std)
            patches.append(patchify(values, self.patch_size, self.merge_size, self.temporal_patch_size))
            grids.append(self.grid_thw(info))
        grid = torch.tensor(grids, dtype=torch.long)
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        return {VIDEOS.patch_key: torch.from_numpy(np.concatenate(patches)), VIDEOS.grid_key: grid}, counts
