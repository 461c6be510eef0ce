"""Ulysses attention: every attention layer of a sequence-parallel language model runs its own packed backend on the
whole row, for 1/N of the heads.

Hooked through transformers' attention-function registry, not by copying model code: for each backend ``b`` a
function ``ulysses_<b>`` is registered that turns (local tokens, all heads) into (all tokens, H/N heads) with one
all-to-all per query / key / value, calls ``b`` exactly as the model would have (the whole row's block-causal
mask, ``SpanMasks``, ``BlockMask`` or ``cu_seq_lens``, all built from the whole row's ``pack_segment_ids``), and
turns the output back with a second all-to-all. Positions were applied before the call (RoPE / M-RoPE rotate q
and k per token, from the whole row's positions sliced to the chunk), so per-head attention on the gathered row is
exactly the unsplit computation. :func:`enable_ulysses` points the language model's config at it; the CP group
reaches the functions only while a forward runs inside ``sequence_sharded(shard)`` (``sequence_parallel``: the
engine's sequence-parallel forward enters it), so a sequence-parallel model run outside one is refused, not split
wrongly.

Why not torch's ``context_parallel`` (what accelerate's ``ParallelismConfig(cp_size=...)`` applies): it shards
ring attention over SDPA with no CPU strategy (measured in torch 2.13: no dispatch on CPU) and takes only
``is_causal``, not a packed row's block-causal mask; DeepSpeed's Ulysses (accelerate's ``sp_backend="deepspeed"``)
is the same registry hook as this one but needs DeepSpeed and CUDA.
"""

from __future__ import annotations

import sys

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import varlen_sdpa  # noqa: F401  (sdpa_varlen's functions are registered before they are wrapped)
from .backends import ATTENTION_BACKENDS, FLASH_BACKENDS
from .sequence_parallel import SequenceShard, all_to_all, sequence_shard
from .unwrap import unwrap_model

PREFIX = "ulysses_"


def inner_backend(attn_implementation: str | None) -> str | None:
    """The backend a ``ulysses_<b>`` name runs per head (any other name is its own)."""
    if attn_implementation and attn_implementation.startswith(PREFIX):
        return attn_implementation[len(PREFIX):]
    return attn_implementation


def _backend_function(module, backend: str):
    """What the model itself would call: its own modeling module's eager function, or the registry's entry."""
    if backend == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]


class _Seen:
    """``target`` with some attributes replaced, everything else read through from it."""

    def __init__(self, target, **replaced):
        self._target = target
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _as_backend(module, backend: str):
    """``module`` as ``backend`` would see it in the model without Ulysses: its config naming ``backend``. Why:
    transformers' flash forward looks its kernels up by ``module.config._attn_implementation``, which here names
    ``ulysses_<backend>``, no flash implementation (a ValueError at the first layer). Only flash reads the name, so
    the other backends get the module itself."""
    if backend not in FLASH_BACKENDS:
        return module
    return _Seen(module, config=_Seen(module.config, _attn_implementation=backend))


def _ulysses(backend: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        """(B, H, L/N, D) query / key / value in, (B, L/N, H, D) out, like every transformers backend."""
        inner = _backend_function(module, backend)
        module = _as_backend(module, backend)
        shard = sequence_shard()
        if shard is None:
            raise RuntimeError(f"{PREFIX}{backend}: this sequence-parallel model ran outside a sequence-parallel "
                               "forward (no CP group is active): run it inside "
                               "mvp_engine.packing.sequence_sharded(shard), as the engine's forward does")
        if shard.size == 1:
            return inner(module, query, key, value, attention_mask, **kwargs)
        query, key, value = (all_to_all(t, scatter_dim=1, gather_dim=2, shard=shard) for t in (query, key, value))
        out, _ = inner(module, query, key, value, attention_mask, **kwargs)  # (B, L, H/N, D)
        return all_to_all(out, scatter_dim=1, gather_dim=2, shard=shard), None

    attention.__name__ = f"{PREFIX}{backend}"
    return attention


def register() -> None:
    """``ulysses_<b>`` for every known backend ``b`` (idempotent; run when this package is imported, after
    ``sdpa_varlen`` registered itself). Each takes ``b``'s mask function, so a mask transformers builds itself is
    the one ``b`` would get."""
    for backend in ATTENTION_BACKENDS:
        AttentionInterface.register(f"{PREFIX}{backend}", _ulysses(backend))
        ALL_MASK_ATTENTION_FUNCTIONS.register(f"{PREFIX}{backend}", ALL_MASK_ATTENTION_FUNCTIONS[backend])


def head_counts(model) -> dict[str, dict[int, list[int]]]:
    """Every head count the all-to-alls split (attention's query and key/value heads, linear attention's key and
    value heads), by config key: each value and the layers that have it (the layers may differ: Gemma 4)."""
    config = unwrap_model(model).config
    text = getattr(config, "text_config", None) or config
    keys = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")
    layers = getattr(text, "per_layer_config", None)
    counts: dict[str, dict[int, list[int]]] = {}
    for index, layer in enumerate([text] if layers is None else layers):
        for key in keys:
            if getattr(layer, key, None) is not None:
                counts.setdefault(key, {}).setdefault(int(getattr(layer, key)), []).append(index)
    return counts


def check_heads(model, size: int) -> None:
    """One line naming the numbers (and the layers, where they differ) when a head count does not split over a CP
    group of ``size`` (the engine adds its config key)."""
    bad = []
    for key, values in head_counts(model).items():
        for value, layers in values.items():
            if value % size:
                where = "" if len(values) == 1 else f" (layers {', '.join(map(str, layers))})"
                bad.append(f"{key}={value}{where}")
    if bad:
        raise ValueError(f"Ulysses splits heads over the CP group, but {', '.join(bad)} is not divisible by {size}")


def enable_ulysses(model, shard: SequenceShard):
    """Make the language model of ``model`` sequence-parallel over a CP group of ``shard.size``: its attention
    layers run ``ulysses_<backend>`` (the vision tower keeps its own backend: it encodes whole images, by share).
    The shard itself is handed over per forward (``sequence_sharded``), not kept. Returns the model."""
    check_heads(model, shard.size)
    config = unwrap_model(model).config
    text = getattr(config, "text_config", None) or config
    if not (text._attn_implementation or "").startswith(PREFIX):
        text._attn_implementation_internal = f"{PREFIX}{text._attn_implementation}"
    return model


register()
