"""Qwen2.5-VL recipe: tiny/pretrained model and processor builders, the sample encoder (with each clip's
``second_per_grid_ts``) and packed model inputs."""

from .encoder import Qwen25VLSampleEncoder
from .model import build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = ["Qwen25VLSampleEncoder", "build_model", "build_processor", "prepare_packed", "prepare_padded"]
