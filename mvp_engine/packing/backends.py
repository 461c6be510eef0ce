"""Every attention backend the project knows, once: its name, how a packed batch reaches it, what training on it
needs. The config check, the packed-input builder, the cost model and the recipes all read this table, so a new
backend is one row here (plus its input builder) instead of five tuples that drift apart."""

from __future__ import annotations

from dataclasses import dataclass

# How a backend takes packing is also how it spends attention work, so the kinds are the cost model's
from mvp_engine.kit.mllm.data.cost import BLOCK_MASK, DENSE_MASK, VARLEN


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: ``packed_inputs`` (``DENSE_MASK``, ``BLOCK_MASK`` or ``VARLEN``), whether training on
    it needs a CUDA GPU, and the package it imports (None: torch alone; a backend with a package runs on CUDA only)."""

    name: str
    packed_inputs: str
    needs_cuda: bool = False
    package: str | None = None


SDPA_VARLEN = "sdpa_varlen"  # mvp_engine/packing/varlen_sdpa.py registers it with transformers
FLEX = "flex_attention"

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    AttentionBackend("eager", DENSE_MASK),
    AttentionBackend("sdpa", DENSE_MASK),
    AttentionBackend(SDPA_VARLEN, VARLEN),
    # torch's FlexAttention has no CPU backward (forward-only checks run on CPU)
    AttentionBackend(FLEX, BLOCK_MASK, needs_cuda=True),
    AttentionBackend("flash_attention_2", VARLEN, needs_cuda=True, package="flash_attn"),
    AttentionBackend("flash_attention_3", VARLEN, needs_cuda=True, package="flash_attn_interface"),
)}
ATTENTION_BACKENDS = tuple(BACKENDS)
FLASH_BACKENDS = tuple(name for name in BACKENDS if name.startswith("flash_attention"))


def is_flash(attn_implementation: str) -> bool:
    return attn_implementation in FLASH_BACKENDS


def takes_varlen_kwargs(attn_implementation: str) -> bool:
    """Backends that pack through ``cu_seq_lens_q/k`` + ``max_length_q/k`` and no mask: flash and sdpa_varlen."""
    backend = BACKENDS.get(attn_implementation)
    return backend is not None and backend.packed_inputs == VARLEN


def packed_inputs(attn_implementation: str) -> str:
    """How ``attn_implementation`` takes packing; an unknown backend is treated as a dense mask (the safe reading for
    cost: it may compute every pair)."""
    backend = BACKENDS.get(attn_implementation)
    return DENSE_MASK if backend is None else backend.packed_inputs
