"""Qwen3.5 recipe: a hybrid (Gated DeltaNet linear attention + full attention) vision-language model, packed without
leaking state between samples: tiny/pretrained builders, the sample encoder and packed model inputs."""

from .model import build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = ["build_model", "build_processor", "prepare_packed", "prepare_padded"]
