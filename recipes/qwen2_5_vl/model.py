"""Model and processor builders for the Qwen2.5-VL recipe.

The default is a tiny, seeded, randomly initialised ``Qwen2_5_VLForConditionalGeneration`` from YAML
(``conf/model/qwen2_5_vl_tiny.yaml``: one windowed and one full-attention vision block, so the tower's window
reordering runs on every image and clip) with vocabulary and special-token ids from the committed tokenizer asset
(``assets/tokenizers/qwen2_5_vl``); ``pretrained=<dir>`` loads a ``save_pretrained`` folder. The builders are the
Qwen families' shared ones (``recipes.qwen``).

Images: ``Qwen2VLImageProcessorPil`` (patch 14, merge 2, CLIP mean/std: Qwen2.5-VL's image processor is Qwen2-VL's).
Videos: the family's ``QwenVideoProcessor`` (numpy/PIL, ``Qwen2VLVideoProcessor``'s sampling and layout, which
Qwen2.5-VL uses), whose ``seconds_per_grid`` gives each clip's ``second_per_grid_ts``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from mvp_engine.engine.grid_vision import grid_dummy_media
from recipes.qwen import (
    QwenVideoProcessor,
    build_qwen_model,
    build_qwen_processor,
    qwen_cost_profile,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "qwen2_5_vl"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Qwen2_5_VLConfig.model_type,)

# Small pixel bounds: every image becomes 4..64 merged tokens (one merged token covers 28x28 pixels).
DEFAULT_IMAGE_PIXELS = (28 * 28 * 4, 28 * 28 * 64)
# Video frames: 4..16 merged tokens per frame pair; 2 frames a second, 4..16 frames per clip.
DEFAULT_VIDEO = QwenVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, fps=2.0, min_frames=4,
                                   max_frames=16)

# Keys read (recipes.qwen): pretrained, tokenizer_dir, image_min_pixels / image_max_pixels (defaults above),
# video_min_pixels / video_max_pixels (per frame), video_fps, video_min_frames, video_max_frames (defaults:
# DEFAULT_VIDEO), and for the model config (text_config, vision_config, top-level Qwen2_5_VLConfig fields), seed,
# dtype.
build_processor = partial(build_qwen_processor, tokenizer_dir=DEFAULT_TOKENIZER_DIR, image_pixels=DEFAULT_IMAGE_PIXELS,
                          video=DEFAULT_VIDEO)
build_model = partial(build_qwen_model, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig,
                      tokenizer_dir=DEFAULT_TOKENIZER_DIR, vision_out="out_hidden_size")
dummy_media = grid_dummy_media
cost_profile = qwen_cost_profile
