"""Qwen3.5-MoE recipe: Qwen3.5's hybrid (Gated DeltaNet + full attention) vision-language model with mixture-of-experts
feed-forward layers, packed without leaking state between samples: its model builder; the encoder, processor and
packed model inputs are Qwen3.5's (``recipes.qwen3_5``, over the family package ``recipes.qwen``)."""

from .model import build_model, build_processor

__all__ = ["build_model", "build_processor"]
