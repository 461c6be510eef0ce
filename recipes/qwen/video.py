"""Videos -> ``pixel_values_videos`` and ``video_grid_thw`` as transformers' Qwen2-VL and Qwen3-VL video processors lay
them out, with numpy and PIL: those processors need torchvision, which does not install beside this torch.

The layout (Qwen2-VL's, which Qwen2.5-VL and Qwen3-VL keep): the sampled frames, each resized to the one size
``smart_resize`` picks for the video (sides multiples of ``patch_size * merge_size``, ``min_pixels`` to
``max_pixels`` per frame), rescaled and normalised, grouped ``temporal_patch_size`` frames at a time (the last frame
repeated to fill the last group), cut into ``patch_size`` squares and flattened in the processor's ``patchify``
order (the kit's ``normalize_frames`` and ``patchify``): one row of ``C * temporal_patch_size * patch_size**2``
values per patch, ``t * h * w`` rows per video, whose ``merge_size**2``-patch blocks become its
``t * h * w / merge_size**2`` placeholder tokens.

Frame sampling is ``Qwen2VLVideoProcessor.sample_frames`` with ``fps`` (how qwen-vl-utils samples for training):
``n = frames / source fps * fps``, clamped to ``[min_frames, min(max_frames, frames)]``, floored to a multiple of
``temporal_patch_size``, indices ``torch.arange(0, frames, frames / n).int()`` (torch, as the processor computes
them). A clip shorter than ``temporal_patch_size`` frames, where that formula leaves no frame, is taken whole.
transformers' optional ``cap_pixels_per_frame`` (a total pixel budget per video) is not applied: its default is off.

``token_count`` needs the :class:`VideoInfo` only (metadata), so ``measure`` never decodes; ``__call__`` (the kit's
:class:`GridPatchVideoProcessor`) decodes the same frames and gives the same counts. Pixel values differ slightly
from transformers' (PIL's bicubic resize of each RGB frame here, torchvision's bicubic on the frame tensor there);
grids, token counts and layout are the same.

:class:`Qwen3VideoProcessor` is ``Qwen3VLVideoProcessor`` (Qwen3-VL and Qwen3.5): the same patch layout, with
``patch_size`` 16 and mean/std 0.5, but its own sampling (``n = int(frames / source fps * fps)`` clamped to
``[min_frames, min(max_frames, frames)]``, not rounded to ``temporal_patch_size``, indices
``np.linspace(0, frames - 1, n).round()``; the last group is filled by repeating the last frame), its own
``smart_resize`` (transformers' function, over the whole clip: ``min_pixels`` / ``max_pixels`` bound frames x height x
width, and a clip of fewer than ``temporal_patch_size`` sampled frames is refused), and the per-frame ``timestamps``
``Qwen3VLProcessor`` writes into the text (the mean source time of each temporal patch's first and last frame).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mvp_engine.kit.mllm.data.video import VideoInfo
from mvp_engine.kit.mllm.data.video_patches import GridPatchVideoProcessor


@dataclass(frozen=True)
class QwenVideoProcessor(GridPatchVideoProcessor):
    """``Qwen2VLVideoProcessor``'s frame sampling and per-frame size on the kit's grid-patch layout."""

    min_frames: int = 4
    max_frames: int = 768

    video_processor_type = "Qwen2VLVideoProcessor"  # written into video_preprocessor_config.json

    def __post_init__(self):
        super().__post_init__()
        if self.min_frames > self.max_frames:
            raise ValueError(f"video processor min/max are inverted: frames {self.min_frames}..{self.max_frames}")
        if self.max_frames < self.temporal_patch_size:
            raise ValueError(f"video processor max_frames={self.max_frames} is invalid: allowed at least "
                             f"temporal_patch_size={self.temporal_patch_size}")

    def frame_indices(self, info: VideoInfo) -> list[int]:
        """The frames sampled from the video, in order."""
        total, step = info.num_frames, self.temporal_patch_size
        most = math.floor(min(self.max_frames, total) / step) * step
        wanted = min(max(total / info.fps * self.fps, self.min_frames), most, total)
        count = math.floor(wanted / step) * step
        if count == 0:
            return list(range(total))
        return torch.arange(0, total, total / count).int().tolist()

    def frame_size(self, info: VideoInfo) -> tuple[int, int]:
        """``(height, width)`` every sampled frame is resized to (raises for an aspect ratio over 200)."""
        return smart_resize(info.height, info.width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)


@dataclass(frozen=True)
class Qwen3VideoProcessor(QwenVideoProcessor):
    """``Qwen3VLVideoProcessor``'s sampling, clip-wide size and frame timestamps on the Qwen2-VL patch layout
    (Qwen3-VL, Qwen3.5). ``min_pixels`` / ``max_pixels`` bound the whole clip (sampled frames x height x width)."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    patch_size: int = 16
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    video_processor_type = "Qwen3VLVideoProcessor"

    def frame_indices(self, info: VideoInfo) -> list[int]:
        """``Qwen3VLVideoProcessor.sample_frames`` with ``fps``."""
        total = info.num_frames
        count = min(max(int(total / info.fps * self.fps), self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()

    def frame_size(self, info: VideoInfo) -> tuple[int, int]:
        """``(height, width)`` of every sampled frame: transformers' clip-wide ``smart_resize`` (raises for fewer
        sampled frames than ``temporal_patch_size`` and for an aspect ratio over 200)."""
        # imported here: the module pulls in transformers' video processing (about a second), which only Qwen3 needs
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_smart_resize

        return clip_smart_resize(len(self.frame_indices(info)), info.height, info.width,
                                 temporal_factor=self.temporal_patch_size, factor=self.patch_size * self.merge_size,
                                 min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def timestamps(self, info: VideoInfo) -> list[float]:
        """Seconds of each temporal patch, as ``Qwen3VLProcessor`` computes them for the text: the sampled indices
        (the last repeated to fill the last patch) over the source rate, first and last frame of a patch averaged."""
        indices, step = self.frame_indices(info), self.temporal_patch_size
        indices += indices[-1:] * (-len(indices) % step)
        seconds = [index / info.fps for index in indices]
        return [(seconds[i] + seconds[i + step - 1]) / 2 for i in range(0, len(seconds), step)]
