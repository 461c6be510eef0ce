"""InternVL recipe: tiny/pretrained model and processor builders, the tiling sample encoder and packed inputs."""

from .encoder import InternVLSampleEncoder
from .model import InternVLProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "InternVLProcessorBundle",
    "InternVLSampleEncoder",
    "build_model",
    "build_processor",
    "prepare_packed",
    "prepare_padded",
]
