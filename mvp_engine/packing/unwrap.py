"""The transformers model inside whatever wraps it for training: every helper reads the model's own config."""

from __future__ import annotations


def unwrap_model(model):
    """The transformers model inside a DDP / accelerate wrapper (which hide ``config`` and ``dtype``)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model
