"""What the recipes over Qwen3-VL checkpoints share (``recipes/qwen3_vl`` dense, ``recipes/qwen3_vl_moe``
mixture-of-experts): one tokenizer asset, one image and video processing, one set of attention backends. The MoE
checkpoints (Qwen3-VL-30B-A3B, 235B-A22B) ship Qwen3-VL's tokenizer and preprocessor configs; only the language
model's MLPs differ.

Images: ``Qwen2VLImageProcessorPil`` configured as Qwen3-VL's image processor (patch 16, merge 2, mean/std 0.5),
transformers' torchvision-free backend. Videos: the family's ``Qwen3VideoProcessor`` (numpy/PIL), which samples,
sizes and timestamps frames as ``Qwen3VLVideoProcessor`` / ``Qwen3VLProcessor`` do; transformers' own needs
torchvision. Its ``min_pixels`` / ``max_pixels`` bound the whole clip (frames x height x width), as Qwen3-VL's do.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from .processor import build_qwen_processor
from .video import Qwen3VideoProcessor

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN3_VL_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen3_vl"

IMAGE_SETTINGS = {"patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Small pixel bounds: every image becomes 4..64 merged tokens (one merged token covers 32x32 pixels).
DEFAULT_IMAGE_PIXELS = (32 * 32 * 4, 32 * 32 * 64)
# Video: the clip's frames x pixels between 4 and 64 merged tokens' worth (2 frames per temporal patch); 2 frames a
# second, 4..16 frames: 2..8 timestamped frame runs per clip.
DEFAULT_VIDEO = Qwen3VideoProcessor(min_pixels=32 * 32 * 2 * 4, max_pixels=32 * 32 * 2 * 64, fps=2.0, min_frames=4,
                                    max_frames=16)

# flex_attention is refused by transformers 5.24 for Qwen3-VL (dense and MoE) at load time.
QWEN3_VL_ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")

# Keys read (recipes.qwen.build_qwen_processor): pretrained, tokenizer_dir, image_min_pixels / image_max_pixels
# (defaults above), video_min_pixels / video_max_pixels (the whole clip), video_fps, video_min_frames,
# video_max_frames (defaults: DEFAULT_VIDEO).
build_qwen3_vl_processor = partial(build_qwen_processor, tokenizer_dir=QWEN3_VL_TOKENIZER_DIR,
                                   image_pixels=DEFAULT_IMAGE_PIXELS, video=DEFAULT_VIDEO, **IMAGE_SETTINGS)
