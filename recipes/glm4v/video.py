"""GLM-4.1V's videos with numpy and PIL (``Glm4vVideoProcessor`` needs torchvision, which does not install beside
this torch): its frame sampling, clip-wide size and per-frame timestamps on the Qwen2-VL patch layout its vision
tower shares (the kit's ``GridPatchVideoProcessor`` supplies the layout, the decoding and the config files).

Sampling is ``Glm4vVideoProcessor.sample_frames`` with ``fps``: for a clip of at most ``max_duration`` seconds
(duration = frames / source fps) ``n = max(floor(duration * fps), 1)`` frames at indices
``min(last, ceil(i * source fps / fps))``, duplicates dropped, the last index repeated when the count is odd (a
temporal patch is two frames). The size is GLM's ``smart_resize`` over the whole clip (sampled frames x height x
width between ``min_pixels`` and ``max_pixels``); the timestamps ``Glm4vProcessor`` writes after each temporal
patch are the source seconds of its first frame, as whole seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from mvp_engine.kit.mllm.data.video import VideoInfo
from mvp_engine.kit.mllm.data.video_patches import GridPatchVideoProcessor


@dataclass(frozen=True)
class Glm4vVideoProcessor(GridPatchVideoProcessor):
    """``Glm4vVideoProcessor``'s sampling (by rate and ``max_duration``), size and timestamps."""

    min_pixels: int = 112 * 112
    max_pixels: int = 28 * 28 * 2 * 30000
    max_duration: float = 300.0

    video_processor_type = "Glm4vVideoProcessor"

    def frame_indices(self, info: VideoInfo) -> list[int]:
        total, rate = info.num_frames, info.fps
        last, duration = total - 1, total / rate
        if duration <= self.max_duration:
            count = max(math.floor(duration * self.fps), 1)
            indices = [min(last, math.ceil(i * rate / self.fps)) for i in range(count)]
        elif (count := int(self.max_duration * self.fps)) >= total:
            indices = list(range(total))
        else:
            indices = [min(last, math.ceil(t * rate)) for t in np.linspace(0, duration, count)]
        indices = list(dict.fromkeys(indices))
        return indices + indices[-1:] * (len(indices) % 2)

    def frame_size(self, info: VideoInfo) -> tuple[int, int]:
        """``(height, width)`` of every sampled frame (raises for an aspect ratio over 200)."""
        return smart_resize(len(self.frame_indices(info)), info.height, info.width,
                            temporal_factor=self.temporal_patch_size, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def timestamps(self, info: VideoInfo) -> list[int]:
        """Whole source seconds of each temporal patch's first frame (``Glm4vProcessor.replace_video_token``)."""
        indices = self.frame_indices(info)[:: self.temporal_patch_size]
        return [int(index / info.fps) for index in indices]
