"""Model and processor builders for the Qwen3-VL recipe.

The default is a tiny, seeded, randomly initialised ``Qwen3VLForConditionalGeneration`` from YAML
(``conf/model/qwen3_vl_tiny.yaml``: its vision tower sets ``deepstack_visual_indexes`` inside its own depth, so the
DeepStack mergers run) with vocabulary and special-token ids from the committed tokenizer asset
(``assets/tokenizers/qwen3_vl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The builders are the
Qwen families' shared ones (the family package ``recipes.qwen``).

Images: ``Qwen2VLImageProcessorPil`` configured as Qwen3-VL's image processor (patch 16, merge 2, mean/std 0.5),
transformers' torchvision-free backend. Videos: the family's ``Qwen3VideoProcessor`` (numpy/PIL), which samples,
sizes and timestamps frames as ``Qwen3VLVideoProcessor`` / ``Qwen3VLProcessor`` do; transformers' own needs
torchvision. Its ``min_pixels`` / ``max_pixels`` bound the whole clip (frames x height x width), as Qwen3-VL's do.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from recipes.qwen import (
    Qwen3VideoProcessor,
    build_qwen_model,
    build_qwen_processor,
    qwen_cost_profile,
    qwen_dummy_media,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen3_vl"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen3VLConfig.model_type,)

IMAGE_SETTINGS = {"patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Small pixel bounds: every image becomes 4..64 merged tokens (one merged token covers 32x32 pixels).
DEFAULT_IMAGE_PIXELS = (32 * 32 * 4, 32 * 32 * 64)
# Video: the clip's frames x pixels between 4 and 64 merged tokens' worth (2 frames per temporal patch); 2 frames a
# second, 4..16 frames: 2..8 timestamped frame runs per clip.
DEFAULT_VIDEO = Qwen3VideoProcessor(min_pixels=32 * 32 * 2 * 4, max_pixels=32 * 32 * 2 * 64, fps=2.0, min_frames=4,
                                    max_frames=16)

# Keys read (recipes.qwen): pretrained, tokenizer_dir, image_min_pixels / image_max_pixels (defaults
# above), video_min_pixels / video_max_pixels (the whole clip), video_fps, video_min_frames, video_max_frames
# (defaults: DEFAULT_VIDEO), and for the model config (text_config, vision_config, top-level Qwen3VLConfig fields),
# seed, dtype.
build_processor = partial(build_qwen_processor, tokenizer_dir=DEFAULT_TOKENIZER_DIR, image_pixels=DEFAULT_IMAGE_PIXELS,
                          video=DEFAULT_VIDEO, **IMAGE_SETTINGS)
build_model = partial(build_qwen_model, Qwen3VLForConditionalGeneration, Qwen3VLConfig,
                      tokenizer_dir=DEFAULT_TOKENIZER_DIR, vision_out="out_hidden_size")
dummy_media = qwen_dummy_media
cost_profile = qwen_cost_profile
