"""Sample encoder for Qwen2.5-VL: Qwen2-VL's layout (``recipes.qwen.QwenSampleEncoder``) plus each clip's
``second_per_grid_ts``.

Qwen2.5-VL's M-RoPE spaces a clip's temporal positions by ``tokens_per_second * second_per_grid_ts`` (the seconds one
temporal patch spans, ``temporal_patch_size`` over the sampled frame rate, as ``Qwen2_5_VLProcessor`` computes it);
without the field the model silently assumes one second per patch. The encoder writes it as a media field with one
entry per clip and declares it (its ``video_kind``, the family's ``TIMED_VIDEOS``: a per-item field of videos), so
it is merged per pack in clip order and reaches the per-segment ``get_rope_index`` with that segment's grids. It
follows from the container metadata alone (``QwenVideoProcessor.seconds_per_grid``): ``measure`` never decodes, and
the value ``encode`` writes is the one the metadata gives.
"""

from __future__ import annotations

import torch

from mvp_engine.kit.mllm.data.video import VideoInfo
from recipes.qwen import QwenSampleEncoder
from recipes.qwen.encoder import TIMED_VIDEOS


class Qwen25VLSampleEncoder(QwenSampleEncoder):
    """Implements ``MLLMSampleEncoder`` for Qwen2.5-VL; every error names ``record.origin``."""

    video_kind = TIMED_VIDEOS

    def encode_videos(self, videos: list[VideoInfo]) -> tuple[dict[str, torch.Tensor], list[int]]:
        media, counts = super().encode_videos(videos)
        seconds = [self.video_processor.seconds_per_grid(info) for info in videos]
        return {**media, "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}, counts
