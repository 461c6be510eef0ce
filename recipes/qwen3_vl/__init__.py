"""Qwen3-VL recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from recipes.qwen import Qwen3SampleEncoder as Qwen3VLSampleEncoder  # the recipe's name for the family encoder

from .model import build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = ["Qwen3VLSampleEncoder", "build_model", "build_processor", "prepare_packed", "prepare_padded"]
