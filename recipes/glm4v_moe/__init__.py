"""GLM-4.5V recipe (``Glm4vMoeForConditionalGeneration``): GLM-4.1V's vision tower, 3-D rope and video layout with a
mixture-of-experts language model. The model class and builder are its own; the tokenizer asset, processor, encoder,
video sampling and packed model inputs are GLM-4.1V's (``recipes.glm4v``)."""

from .model import Glm4vMoeMixedMediaForConditionalGeneration, build_model, build_processor

__all__ = ["Glm4vMoeMixedMediaForConditionalGeneration", "build_model", "build_processor"]
