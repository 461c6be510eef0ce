"""Qwen3-VL-MoE recipe (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL with sparse-MoE language-model MLPs; everything but
the model class is Qwen3-VL's, from the family package ``recipes.qwen``."""

from .model import build_model, build_processor
from .packed import prepare_packed, prepare_padded

__all__ = ["build_model", "build_processor", "prepare_packed", "prepare_padded"]
