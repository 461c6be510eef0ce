"""Packing through linear-attention (Gated DeltaNet) layers: no recurrent state and no conv window crosses a sample.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next in transformers 5.24) interleave full-attention layers with Gated
DeltaNet layers: a short causal depthwise conv1d over the q/k/v projections, then a recurrent state updated token
by token (the gated delta rule, computed in chunks). A block-causal mask does nothing for them: unless they are
told where each packed sample starts, the conv window (``linear_conv_kernel_dim - 1`` tokens back) and the
recurrent state carry one sample into the next.

What transformers 5.24 does with the boundaries (``modeling_qwen3_5.py``, ``integrations/hub_kernels.py``; the
Qwen3.5-MoE and Qwen3-Next modules are the same code): ``Qwen3_5GatedDeltaNet.forward`` calls the module-level
``causal_conv1d_fn(mixed_qkv, weight, bias, activation=..., **kwargs)``, with the decoder's ``cu_seq_lens_q`` still
in ``kwargs``, then ``torch_chunk_gated_delta_rule(..., cu_seqlens=kwargs.pop("cu_seq_lens_q"))``. Both names are
``use_kernel_func_from_hub_with_fallback`` wrappers that keep only the keywords the implementation declares:

- conv1d: ``cu_seq_lens_q`` is declared by neither the torch fallback nor the causal-conv1d CUDA kernel (which
  wants ``seq_idx``), so it is dropped on every device: the window always runs across the boundary.
- gated delta rule, torch fallback (no flash-linear-attention, e.g. CPU): raises when ``cu_seqlens`` is given,
  runs across the boundary when it is not (eager/sdpa never give it). With fla installed the kernel takes
  ``cu_seqlens`` but only for a batch of one flattened row (unverified here: no GPU, no fla).

Measured on the tiny Qwen3.5 of ``recipes/qwen3_5`` (2 linear + 2 full-attention layers, fp32, CPU; the kit's
packed case: two rows of text, image and video samples; the right block-causal mask or varlen kwargs for the
full-attention layers): max |packed - one-by-one| logit difference before this module 1.7e-1 on eager and on sdpa,
silently (the conv window alone 9.3e-2, the state alone 1.0e-1), sdpa_varlen refused by transformers' ValueError;
after it (:func:`enable_linear_attention_packing` and ``cu_seq_lens_q`` from ``prepare_packed_inputs``) 2.4e-7 on
all three (``recipes/qwen3_5/tests``; tolerance 1e-5). With transformers' default decay init (rates up to 16: the
state forgets within a token or two) the leak was 7.5e-2 on random tokens, almost all of it the conv window.

Which layer classes are safe to wrap is the recipe's to declare (``enable_linear_attention_packing(model,
layer_classes)``: classes whose forward it read and found calling exactly these two module functions); this module
names no model. A model whose config lists a linear-attention layer that is not of a declared class is refused, so
an unread layer never packs silently.

The fix replaces those two module-level names, in the modeling module of each linear-attention layer class the
model holds and nowhere else, by wrappers that run transformers' own torch reference per sample when boundaries are
given (``cu_seq_lens_q`` / ``cu_seqlens`` over the flattened B*L tokens, as flash takes them) and call the original
unchanged when they are not: every unpacked forward, cached decoding and every other model behave as before.
Idempotent (a second call finds its wrapper and does nothing). The per-sample path is the torch reference, exact on
every device and the CPU's path; on CUDA with flash-linear-attention installed the gated delta rule runs fla's
``chunk_gated_delta_rule`` once over the flattened (1, B*L) batch with ``cu_seqlens`` instead (:func:`chunk_rule_kernel`
says which and why; the start line prints it), since the reference loops over L/64 chunks in Python per layer.
``tools/gpu_check.py`` compares the two on a GPU. The conv stays the reference on every device (one call for all
samples; causal-conv1d's CUDA kernel would need ``seq_idx`` and a channel-last layout, unverified here).

- conv1d: each sample's tokens are laid out after ``kernel - 1`` zeros (what the conv's own padding gives one
  sample alone), one reference call over the whole laid-out sequence, the samples' outputs gathered back.
- gated delta rule: samples grouped by their length rounded up to the chunk size, each group one batched reference
  call from a zero state (zero padding at the end of a sample changes none of its outputs, nor its final state:
  zero keys write nothing and zero log-decay keeps the state).

:func:`ensure_linear_attention_boundaries` is the guard ``prepare_packed_inputs`` runs: a packed forward of a model
with linear-attention layers must carry ``cu_seq_lens_q`` and run the wrappers, or it raises before the first step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from .batch_metadata import host_bounds
from .sequence_parallel import all_to_all, sequence_shard
from .unwrap import unwrap_model

LINEAR_ATTENTION = "linear_attention"  # the layer_types entry of a linear-attention layer
BOUNDARIES = "cu_seq_lens_q"  # the kwarg the model hands its linear-attention layers (over the flattened B*L tokens)
CONV = "causal_conv1d_fn"
CHUNK_RULE = "torch_chunk_gated_delta_rule"
_MARK = "_packs_by_boundaries"  # set on our wrappers: the install is idempotent and the guard can see it
_DECLARED = "_linear_attention_classes"  # set on the model by the install: the classes its recipe declared
FLA_MODULE = "fla.ops.gated_delta_rule"  # flash-linear-attention's gated delta rule kernels
FLA_KERNEL, TORCH_REFERENCE = "fla", "torch reference"


def linear_attention_layers(model, layer_classes: Collection[type]) -> list[torch.nn.Module]:
    """The model's modules of exactly ``layer_classes`` (a subclass may run a forward nobody read)."""
    return [m for m in unwrap_model(model).modules() if type(m) in tuple(layer_classes)]


def _linear_layer_count(model) -> int:
    """Linear-attention layers the model's config lists (its own ``layer_types`` or its text config's)."""
    config = unwrap_model(model).config
    return max(list(getattr(cfg, "layer_types", None) or ()).count(LINEAR_ATTENTION)
               for cfg in (config, getattr(config, "text_config", None)))


def has_linear_attention(model) -> bool:
    """True when a config of the model lists a ``linear_attention`` layer."""
    return _linear_layer_count(model) > 0


def _modules_of(model, layer_classes: Collection[type]) -> dict[str, ModuleType]:
    """Layer class name -> its modeling module, refusing a model with a linear-attention layer of a class its recipe
    did not declare, or one whose forward was replaced."""
    layers, listed = linear_attention_layers(model, layer_classes), _linear_layer_count(model)
    if len(layers) != listed:
        raise NotImplementedError(
            f"{type(unwrap_model(model)).__name__} lists {listed} linear-attention layers, {len(layers)} of them of "
            f"the classes declared boundary-aware ({sorted(c.__name__ for c in layer_classes)}): the others would "
            "carry their recurrent state and conv window from one packed sample into the next")
    out = {}
    for layer in layers:
        name = type(layer).__name__
        module = sys.modules[type(layer).__module__]
        forward = getattr(type(layer), "forward", None)
        if "forward" in vars(layer) or getattr(forward, "__module__", None) != module.__name__:
            # a hub kernel (kernels' kernelize) or a user patch replaced the forward read for this module
            raise NotImplementedError(f"{name} runs a replaced forward: whether it keeps packed samples apart is "
                                      "unverified, so packing through it is refused")
        out[name] = module
    return out


def _spans(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    bounds = host_bounds(cu_seqlens)
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"linear attention: {BOUNDARIES} must rise from 0 to all {total} tokens, got {bounds[:4]}.."
                         f"{bounds[-2:]}")
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _reference(original: Callable, name: str) -> Callable:
    """transformers' torch implementation under its kernel-dispatch wrapper (``functools.wraps`` chain)."""
    reference = inspect.unwrap(original)
    if reference.__name__ != name:
        raise NotImplementedError(f"{name} unwraps to {reference.__name__}: not the torch reference this packing "
                                  "was checked against")
    return reference


def _varlen_conv1d(original: Callable) -> Callable:
    reference = _reference(original, CONV)

    def per_sample(hidden_states, weight, bias, activation, bounds):
        batch, channels, length = hidden_states.shape
        spans = _spans(bounds, batch * length)
        flat = hidden_states.transpose(0, 1).reshape(channels, batch * length)
        # every sample after kernel - 1 zeros: each output's window then holds only its own sample (or zeros),
        # exactly the conv's own padding on the sample alone; one reference call for all samples
        gap = weight.shape[-1] - 1
        sizes = torch.tensor([b - a for a, b in spans], device=flat.device)
        inserted = gap * torch.arange(1, len(spans) + 1, device=flat.device)  # zeros before and at each sample
        where = (torch.repeat_interleave(inserted, sizes, output_size=batch * length)
                 + torch.arange(batch * length, device=flat.device))
        laid = flat.new_zeros(channels, batch * length + gap * len(spans)).index_copy(1, where, flat)
        out = reference(laid[None], weight, bias, activation=activation)[0].index_select(1, where)
        return out.reshape(channels, batch, length).transpose(0, 1)

    @functools.wraps(original)
    def conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds = kwargs.pop(BOUNDARIES, None)
        bounds = kwargs.pop("cu_seqlens", None) if bounds is None else bounds
        if bounds is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        shard = sequence_shard()
        if shard is None or shard.size == 1:
            return per_sample(hidden_states, weight, bias, activation, bounds)
        # context parallelism: the conv is depthwise, so any split of its channels runs alone; 1/N of them over
        # the whole row (its boundaries), then back to this rank's tokens
        whole = all_to_all(hidden_states, scatter_dim=1, gather_dim=2, shard=shard)
        mine = [None if t is None else t.chunk(shard.size, dim=0)[shard.rank] for t in (weight, bias)]
        out = per_sample(whole, mine[0], mine[1], activation, bounds)
        return all_to_all(out, scatter_dim=2, gather_dim=1, shard=shard)

    setattr(conv1d, _MARK, True)
    return conv1d


def fla_varlen(kernel: Callable, query, key, value, g, beta, chunk_size, output_final_state,
               use_qk_l2norm_in_kernel, cu_seqlens):
    """The gated delta rule of every sample by one ``kernel`` call (fla's ``chunk_gated_delta_rule``) over the batch
    flattened to one row of B*L tokens with ``cu_seqlens`` (int64), as fla takes packed sequences: the keywords
    transformers' Qwen3.5 layer hands it (its own chunk size, 64, is fla's fixed one). Returns the (B, L, ...) output
    and each sample's final state, as the reference path does."""
    batch, length = query.shape[:2]
    flat = [t.reshape(1, batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
    out, states = kernel(*flat[:3], g=flat[3], beta=flat[4], initial_state=None,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens.to(torch.long))
    return out.reshape(batch, length, *out.shape[2:]), (states if output_final_state else None)


def _varlen_chunk_rule(original: Callable) -> Callable:
    reference = _reference(original, CHUNK_RULE)

    def per_sample(query, key, value, g, beta, chunk_size, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        batch, length = query.shape[:2]
        spans = _spans(cu_seqlens, batch * length)
        sizes = [b - a for a, b in spans]
        pieces = [torch.split(t.reshape(batch * length, *t.shape[2:]), sizes) for t in (query, key, value, g, beta)]
        groups: dict[int, list[int]] = {}
        for index, n in enumerate(sizes):
            groups.setdefault(-(-n // chunk_size) * chunk_size, []).append(index)
        outputs: list[torch.Tensor | None] = [None] * len(spans)
        states: list[torch.Tensor | None] = [None] * len(spans)
        for padded, indices in groups.items():
            stacked = [torch.stack([F.pad(parts[i], (0, 0) * (parts[i].dim() - 1) + (0, padded - sizes[i]))
                                    for i in indices]) for parts in pieces]
            q, k, v, gate, b = stacked
            out, state = reference(q, k, v, g=gate, beta=b, chunk_size=chunk_size, initial_state=None,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            for j, i in enumerate(indices):
                outputs[i] = out[j, : sizes[i]]
                states[i] = None if state is None else state[j]
        out = torch.cat(outputs).reshape(batch, length, *outputs[0].shape[1:])
        return out, (torch.stack(states) if output_final_state else None)  # per sample, as fla returns them

    @functools.wraps(original)
    def chunk_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                   **kwargs):
        if cu_seqlens is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        if initial_state is not None:
            raise ValueError("linear attention: packed samples start from a zero state; got an initial_state")
        kernel = fla_chunk_rule() if chunk_rule_kernel(query.device.type)[0] == FLA_KERNEL else None
        varlen = per_sample if kernel is None else functools.partial(fla_varlen, kernel)
        shard = sequence_shard()
        if shard is None or shard.size == 1:
            return varlen(query, key, value, g, beta, chunk_size, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens)
        if output_final_state:
            raise ValueError("linear attention under context parallelism keeps no final state (training only)")
        # context parallelism: the delta rule runs per head, so 1/N of the heads over the whole row (key heads and
        # value heads split alike: the reference repeats key head i for value heads i*r .. i*r + r - 1)
        whole = [all_to_all(t, scatter_dim=2, gather_dim=1, shard=shard) for t in (query, key, value, g, beta)]
        out, _ = varlen(*whole, chunk_size, False, use_qk_l2norm_in_kernel, cu_seqlens)
        return all_to_all(out, scatter_dim=1, gather_dim=2, shard=shard), None

    setattr(chunk_rule, _MARK, True)
    return chunk_rule


_WRAPPERS = {CONV: _varlen_conv1d, CHUNK_RULE: _varlen_chunk_rule}


def fla_chunk_rule() -> Callable | None:
    """flash-linear-attention's ``chunk_gated_delta_rule`` (the varlen kernel transformers itself dispatches to when
    the package imports), None where it does not import (not installed, or no Triton)."""
    try:
        return getattr(importlib.import_module(FLA_MODULE), "chunk_gated_delta_rule", None)
    except Exception:  # noqa: BLE001 - any failed import means the kernel is not there
        return None


def chunk_rule_kernel(device_type: str) -> tuple[str, str]:
    """Which gated delta rule packed linear-attention layers run on ``device_type``: ``(FLA_KERNEL | TORCH_REFERENCE,
    why)``. fla's Triton kernel on CUDA where flash-linear-attention imports, else the exact torch reference per
    sample."""
    if device_type != "cuda":
        return TORCH_REFERENCE, f"the exact torch reference per sample on {device_type} (fla's kernels run on CUDA)"
    if fla_chunk_rule() is None:
        return TORCH_REFERENCE, ("the exact torch reference per sample: flash-linear-attention is not installed "
                                 "(pip install flash-linear-attention for its varlen kernel)")
    return FLA_KERNEL, "fla chunk_gated_delta_rule over the flattened batch with cu_seqlens (CUDA, fla installed)"


def describe_linear_attention(model, device_type: str) -> str | None:
    """The start line's words on a model's linear-attention layers (None: it has none)."""
    return f"linear attention: {chunk_rule_kernel(device_type)[1]}" if has_linear_attention(model) else None


def enable_linear_attention_packing(model, layer_classes: Collection[type]):
    """Make the model's linear-attention layers, all of ``layer_classes`` (the recipe's: classes whose forward calls
    exactly the two module functions wrapped here), keep packed samples apart when given ``cu_seq_lens_q`` (see the
    module doc); idempotent, a no-op for a model without linear-attention layers. Returns the model."""
    layer_classes = tuple(layer_classes)
    for layer_name, module in _modules_of(model, layer_classes).items():
        for name, wrap in _WRAPPERS.items():
            current = getattr(module, name, None)
            if current is None:
                raise NotImplementedError(f"{module.__name__} has no {name}: {layer_name} cannot be told where "
                                          "packed samples start")
            if not getattr(current, _MARK, False):
                setattr(module, name, wrap(current))
    setattr(unwrap_model(model), _DECLARED, layer_classes)
    return model


def linear_attention_enabled(model) -> bool:
    """Every linear-attention layer's module runs the boundary-aware wrappers (the layers of the classes
    :func:`enable_linear_attention_packing` was given for this model; none were: only a model without any)."""
    declared = getattr(unwrap_model(model), _DECLARED, None)
    if declared is None:
        return not has_linear_attention(model)
    return all(getattr(getattr(module, name, None), _MARK, False)
               for module in _modules_of(model, declared).values() for name in _WRAPPERS)


def ensure_linear_attention_boundaries(model, kwargs: Mapping[str, Any]) -> None:
    """Guard: a packed forward of a model with linear-attention layers needs the boundary-aware wrappers and
    ``cu_seq_lens_q`` covering every token, or one sample's state and conv window leak into the next."""
    if not has_linear_attention(model):
        return
    if not linear_attention_enabled(model):
        raise ValueError(
            "this model's linear-attention layers ignore packed-sample boundaries in transformers 5.24 (their state "
            "and conv window would run from one sample into the next): call "
            "mvp_engine.packing.enable_linear_attention_packing(model, layer_classes) after building it")
    bounds = kwargs.get(BOUNDARIES)
    if bounds is None:
        raise ValueError(f"packed forward of a model with linear-attention layers needs {BOUNDARIES} (the samples' "
                         "boundaries over the flattened batch): without it their state runs across samples")
    input_ids = kwargs.get("input_ids")
    if input_ids is not None:
        _spans(bounds, input_ids.numel())
