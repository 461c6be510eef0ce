"""Qwen2-VL recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from recipes.qwen import packed_position_ids

from .encoder import Qwen2VLSampleEncoder
from .model import Qwen2VLProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "Qwen2VLProcessorBundle",
    "Qwen2VLSampleEncoder",
    "build_model",
    "build_processor",
    "packed_position_ids",
    "prepare_packed",
    "prepare_padded",
]
