"""Mixture-of-experts layers: choosing how their experts compute (refused in one line where that cannot run), and
keeping the model's own load-balancing loss out of packed forwards.

transformers 5.24 keeps a MoE layer's experts as 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``) behind an ``experts_implementation`` switch (``integrations/moe.py``): ``eager`` loops over the experts
hit, ``batched_mm`` gathers each token's expert weights, ``grouped_mm`` sorts the (token, expert) pairs by expert
and runs ``torch.nn.functional.grouped_mm`` (its default; on torch 2.13's CPU build it runs in fp32, and in bf16 /
fp16 only where every row is 16-byte aligned, measured: "strides should be multiple of 16 bytes"), ``deepgemm`` and
``sonicmoe`` are CUDA kernels from packages of their own. Every one computes each token's top-k experts only, so
packed and one-by-one forwards route and compute the same (a token's expert output depends on the token alone).

:func:`set_experts_implementation` is what a recipe with experts calls from ``build_model`` with its
``model.experts_implementation`` key: transformers' own ``set_experts_implementation`` (fresh and pretrained models
alike) after checks that name the key, so a run that cannot compute its experts stops before the first step rather
than at the first forward or inside a kernel.

:func:`without_model_aux_loss` wraps a recipe's ``prepare_packed`` / ``prepare_padded`` so every forward passes
``output_router_logits=False``: with it on (a checkpoint's config may set it) transformers' MoE models record every
router's logits and form their own load-balancing loss over the forward's rows, a packed row's padding included (no
``attention_mask`` reaches them under packing; the 4-D block mask of eager / sdpa cannot go through it at all). The
engine forms that loss itself over the optimizer step's real tokens (``router_balance``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .config import ConfigError

KEY = "model.experts_implementation"
CPU_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")  # run on torch's CPU build (grouped_mm: aligned rows)
CUDA_ONLY = {"deepgemm": "DeepGEMM's CUDA kernels", "sonicmoe": "SonicMoE's CUDA kernels"}
ALIGNMENT_BYTES = 16  # grouped_mm's stride rule for every row of its operands


def expert_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's fused expert weights: the 3-D parameters (one slice per expert) of modules that are no
    convolution (a conv1d's weight is 3-D too)."""
    return [(f"{prefix}.{name}" if prefix else name, p) for prefix, module in model.named_modules()
            if not isinstance(module, torch.nn.modules.conv._ConvNd)
            for name, p in module.named_parameters(recurse=False) if p.dim() == 3]


def check_experts_implementation(model: torch.nn.Module, name: str, cuda: bool | None = None) -> None:
    """Raise one ``ConfigError`` line naming :data:`KEY` where ``name`` cannot compute ``model``'s experts here:
    a model without fused experts, a name transformers does not know, a CUDA kernel without CUDA (``cuda``: whether
    this process sees one; None: ask torch), ``grouped_mm`` in a 2-byte dtype over rows not 16-byte aligned."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = expert_parameters(model)
    if not experts:
        raise ConfigError(f"{KEY}={name!r} is invalid: {type(model).__name__} has no experts")
    known = ("eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys()))
    if name not in known:
        raise ConfigError(f"{KEY}={name!r} is invalid: allowed {', '.join(known)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if name in CUDA_ONLY and not cuda:
        raise ConfigError(f"{KEY}={name!r} cannot run here: {CUDA_ONLY[name]} need a CUDA device; on this machine "
                          f"use one of {', '.join(CPU_IMPLEMENTATIONS)}")
    if name == "grouped_mm":
        for param_name, param in experts:
            row = param.shape[-1] * param.element_size()  # grouped_mm reads each expert's rows (and the transpose)
            column = param.shape[-2] * param.element_size()
            if row % ALIGNMENT_BYTES or column % ALIGNMENT_BYTES:
                raise ConfigError(
                    f"{KEY}='grouped_mm' cannot run on {param_name} {tuple(param.shape)} in {param.dtype}: its rows "
                    f"are not {ALIGNMENT_BYTES}-byte aligned (expert sizes divisible by "
                    f"{ALIGNMENT_BYTES // param.element_size()} in this dtype, or {KEY}=eager / batched_mm)")


def set_experts_implementation(model, name: str | None, cuda: bool | None = None):
    """``model`` with its experts computed by ``name`` (None: leave transformers' choice), checked first
    (:func:`check_experts_implementation`). Returns the model."""
    if name is None:
        return model
    check_experts_implementation(model, str(name), cuda)
    model.set_experts_implementation(str(name))
    return model


NO_MODEL_AUX = {"output_router_logits": False}


def without_model_aux_loss(prepare: Callable[..., dict]) -> Callable[..., dict]:
    """``prepare(batch, model, attn_implementation)`` whose kwargs also switch the model's own aux loss off."""

    @functools.wraps(prepare)
    def prepare_without_model_aux(batch: dict, model, attn_implementation: str) -> dict:
        return {**prepare(batch, model, attn_implementation), **NO_MODEL_AUX}

    return prepare_without_model_aux
