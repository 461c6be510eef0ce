"""What the Gemma recipes share (Gemma 3, Gemma 4): tokens and chat template, the sample encoder's layout and token
types, and packed inputs with one mask per layer type built from the project's predicates."""

from .encoder import GemmaSampleEncoder
from .packed import ATTENTION_BACKENDS, prepare_packed, prepare_padded

__all__ = ["ATTENTION_BACKENDS", "GemmaSampleEncoder", "prepare_packed", "prepare_padded"]
