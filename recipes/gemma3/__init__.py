"""Gemma 3 recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from .encoder import Gemma3SampleEncoder
from .model import Gemma3ProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "Gemma3ProcessorBundle",
    "Gemma3SampleEncoder",
    "build_model",
    "build_processor",
    "prepare_packed",
    "prepare_padded",
]
