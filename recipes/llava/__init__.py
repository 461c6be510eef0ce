"""LLaVA recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from .encoder import LlavaSampleEncoder
from .model import LlavaProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "LlavaProcessorBundle",
    "LlavaSampleEncoder",
    "build_model",
    "build_processor",
    "prepare_packed",
    "prepare_padded",
]
