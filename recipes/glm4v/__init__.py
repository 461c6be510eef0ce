"""GLM-4.1V / 4.5V recipe: tiny/pretrained model and processor builders, the sample encoder and packed model inputs."""

from .encoder import Glm4vSampleEncoder
from .model import Glm4vMixedMediaForConditionalGeneration, Glm4vProcessorBundle, build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = [
    "Glm4vMixedMediaForConditionalGeneration",
    "Glm4vProcessorBundle",
    "Glm4vSampleEncoder",
    "build_model",
    "build_processor",
    "prepare_packed",
    "prepare_padded",
]
