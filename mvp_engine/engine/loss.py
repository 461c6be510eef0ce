"""Loss reductions that stay exact under gradient accumulation and data parallelism.

Every reduction is a weighted sum over supervised tokens divided by the sum of the weights over the whole
optimizer step (all micro-batches, all ranks): ``token`` weighs each token 1, ``sample`` weighs a sample's
tokens 1/n so each sample counts once, ``square`` (InternVL) weighs them 1/sqrt(n). Since no sample spans two
micro-batches, weights are known per micro-batch and only the denominator needs the whole step.

Under context parallelism a rank holds the logits of a chunk ``[start, end)`` of every row (``span``): position q
predicts token q + 1 whether or not q + 1 is on the same rank (every rank has the whole rows' labels), the row's last
position predicts nothing, and the weights are those of the whole rows (a sample's count spans chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mvp_engine.kit.mllm.data import IGNORE_INDEX

REDUCTIONS = ("token", "sample", "square")


@dataclass
class WeightedTokenLoss:
    """Numerator (weighted sum of token losses) and denominator (sum of weights) of one micro-batch."""

    weighted_sum: torch.Tensor
    weight_total: torch.Tensor


def token_weights(labels: torch.Tensor, segment_ids: torch.Tensor, reduction: str,
                  span: tuple[int, int] | None = None) -> torch.Tensor:
    """Per-target-token weights (shape ``[B, L-1]``, zero where unsupervised) for the shifted labels; with
    ``span``, those of the logits at positions ``[start, end)`` (``[B, end - start]``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"train.loss_reduction={reduction!r} is invalid: allowed one of {list(REDUCTIONS)}")
    targets = labels[:, 1:]
    supervised = (targets != IGNORE_INDEX).to(torch.float64)
    if reduction == "token" or supervised.numel() == 0:  # an all-padding row can be one token wide
        return _in_span(supervised, span, 0.0)
    width = segment_ids.shape[1]
    rows = torch.arange(segment_ids.shape[0], device=segment_ids.device).unsqueeze(1)
    owner = (rows * (width + 1) + segment_ids[:, 1:] + 1).reshape(-1)  # one id per (row, segment)
    counts = torch.zeros(int(owner.max()) + 1, dtype=torch.float64, device=labels.device)
    counts.index_add_(0, owner, supervised.reshape(-1))
    per_token_count = counts[owner].reshape(supervised.shape).clamp(min=1.0)
    scale = per_token_count if reduction == "sample" else per_token_count.sqrt()
    return _in_span(supervised / scale, span, 0.0)


def _in_span(per_target: torch.Tensor, span: tuple[int, int] | None, last) -> torch.Tensor:
    """``per_target`` (one column per position 0 .. L-2) at positions ``span``, ``last`` at position L-1."""
    return per_target if span is None else F.pad(per_target, (0, 1), value=last)[:, span[0]:span[1]]


def shifted_targets(labels: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
    """The token each position predicts (``labels`` shifted by one, ``IGNORE_INDEX`` where none is supervised):
    ``[B, L-1]``, or with ``span`` those of positions ``[start, end)`` (``[B, end - start]``). Shifted on the whole
    rows before the span is taken, so a CP rank's last position predicts the next rank's first token."""
    return _in_span(labels[:, 1:], span, IGNORE_INDEX)


def weighted_token_loss(logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor,
                        reduction: str, span: tuple[int, int] | None = None) -> WeightedTokenLoss:
    """Cross-entropy of next-token prediction, summed with the reduction's weights; ``span``: ``logits`` are those
    of positions ``[start, end)`` of the rows (a CP rank's chunk)."""
    weights = token_weights(labels, segment_ids, reduction, span)
    targets = shifted_targets(labels, span).clamp(min=0)
    predicting = logits[:, :-1] if span is None else logits
    per_token = F.cross_entropy(predicting.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                reduction="none").reshape(targets.shape)
    return WeightedTokenLoss((per_token * weights.to(per_token.dtype)).sum(), weights.sum())
