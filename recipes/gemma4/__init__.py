"""Gemma 4 recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from .encoder import Gemma4SampleEncoder
from .model import Gemma4ProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "Gemma4ProcessorBundle",
    "Gemma4SampleEncoder",
    "build_model",
    "build_processor",
    "prepare_packed",
    "prepare_padded",
]
