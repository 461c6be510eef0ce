"""A continuation's attention over a shared prefix and itself: two fused calls merged exactly by log-sum-exp.

Why: a preference pair's segment holds its prefix once and then two continuations (``branches.py``); a
continuation's queries see every prefix key and their own keys causally, never the other continuation's. One sdpa
call over the whole segment would need an n x n mask (fused kernels skip no tile of a mask, and the block between
the two continuations is work thrown away). Two calls on contiguous slices of the packed tensors do the useful work
alone, with no mask: the continuation's queries against the prefix (every key, not causal) and against the
continuation itself (causal). Softmax over the union of both key sets is the two partial outputs weighted by
``exp(lse_part - lse)`` with ``lse = logaddexp(lse_prefix, lse_own)``: exact, as flash attention's tiles combine.

The gradient: torch's fused kernels return the log-sum-exp but do not differentiate through it, so the merge is one
autograd Function whose backward runs each part's fused backward with the MERGED output and log-sum-exp. That
backward forms each key's weight as ``exp(score - lse)`` and the row term ``rowsum(dO * O)`` from what it is given,
which are then those of the whole softmax, so the two parts' gradients are exactly the merged attention's (the
scheme ring attention uses). Grouped-query heads pass as they are (the kernel pairs them, as ``enable_gqa`` does).

CPU only: torch 2.13 returns the log-sum-exp and takes it back in the backward through
``_scaled_dot_product_flash_attention_for_cpu`` (the kernel ``F.scaled_dot_product_attention`` runs on CPU) and
``..._backward``; CUDA's counterparts have other signatures and layouts, unchecked here, so another device is
refused in one line (the run lays such pairs out with their prefix duplicated instead, ``shared_prefix_obstacle``).
Measured (float64, against one masked sdpa call over the concatenated keys): output and every gradient within 1e-15.
"""

from __future__ import annotations

import torch

from .backends import SDPA_VARLEN, takes_varlen_kwargs

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
DEVICE_TYPES = ("cpu",)  # where the merge runs (module docstring)


def shared_prefix_obstacle(attn_implementation: str, device_type: str) -> str | None:
    """Why ``attn_implementation`` on ``device_type`` cannot keep a pair's two continuations apart in one segment
    (None: it can). The mask backends express the branches; sdpa_varlen merges them on the CPU; flash's kernels take
    one causal span per segment."""
    if not takes_varlen_kwargs(attn_implementation):
        return None
    if attn_implementation != SDPA_VARLEN:
        return f"{attn_implementation} takes one causal span per segment"
    if device_type not in DEVICE_TYPES:
        return f"{SDPA_VARLEN} merges a shared prefix's attention on the CPU only, not on {device_type}"
    return None


class _PrefixMerged(torch.autograd.Function):
    """(1, H, n, D) queries against the prefix's keys (all) and their own (causal), merged (module docstring)."""

    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, scale):
        out_prefix, lse_prefix = _FORWARD(query, prefix_key, prefix_value, 0.0, False, scale=scale)
        out_own, lse_own = _FORWARD(query, key, value, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)
        out = (torch.exp(lse_prefix - lse).unsqueeze(-1) * out_prefix
               + torch.exp(lse_own - lse).unsqueeze(-1) * out_own).to(query.dtype)
        ctx.scale = scale
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, prefix_key, prefix_value, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_prefix, dk_prefix, dv_prefix = _BACKWARD(grad, query, prefix_key, prefix_value, out, lse, 0.0, False,
                                                    scale=ctx.scale)
        dq_own, dk_own, dv_own = _BACKWARD(grad, query, key, value, out, lse, 0.0, True, scale=ctx.scale)
        return dq_prefix + dq_own, dk_prefix, dv_prefix, dk_own, dv_own, None


def prefix_merged_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of a continuation's (1, H, n, D) ``query`` over every prefix key and, causally, its own ``key``
    (both (1, H_kv, m, D)): softmax over the union, differentiable in every input."""
    if query.device.type not in DEVICE_TYPES:
        raise ValueError(shared_prefix_obstacle(SDPA_VARLEN, query.device.type))
    return _PrefixMerged.apply(query, prefix_key, prefix_value, key, value, scale)
