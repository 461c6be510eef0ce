"""Loss reductions: exact under gradient accumulation, and packed equal to one-by-one per reduction."""

from __future__ import annotations

import math

import pytest
import torch

from mvp_engine.engine.loss import token_weights, weighted_token_loss
from mvp_engine.kit.mllm.data import IGNORE_INDEX

from .fakes import packed_segments_and_labels

VOCAB = 11


def segments_and_labels(lengths_per_row, width, seed=0):
    return packed_segments_and_labels(lengths_per_row, width, VOCAB, seed)


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_weights_per_sample(reduction):
    seg, labels = segments_and_labels([[3, 5], [4]], 9)
    weights = token_weights(labels, seg, reduction)
    per_sample = [(0, 0), (0, 1), (1, 0)]
    supervised = {(0, 0): 2, (0, 1): 4, (1, 0): 3}
    for row, s in per_sample:
        mask = seg[row, 1:] == s
        total = float(weights[row][mask].sum())
        n = supervised[(row, s)]
        expected = {"token": n, "sample": 1.0, "square": math.sqrt(n)}[reduction]
        assert total == pytest.approx(expected)


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_accumulated_micro_batches_equal_one_batch(reduction):
    seg, labels = segments_and_labels([[3, 5], [4, 2, 2], [7], [2, 2, 2, 2]], 9, seed=1)
    logits = torch.randn(4, 9, VOCAB, generator=torch.Generator().manual_seed(2))
    whole = weighted_token_loss(logits, labels, seg, reduction)
    reference = whole.weighted_sum / whole.weight_total
    parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
    denominator = sum(token_weights(labels[p], seg[p], reduction).sum() for p in parts)
    accumulated = sum(weighted_token_loss(logits[p], labels[p], seg[p], reduction).weighted_sum for p in parts)
    assert float(accumulated / denominator) == pytest.approx(float(reference), rel=1e-6)


def test_sample_reduction_is_mean_of_per_sample_means():
    seg, labels = segments_and_labels([[3, 6]], 9, seed=3)
    logits = torch.randn(1, 9, VOCAB, generator=torch.Generator().manual_seed(4))
    packed = weighted_token_loss(logits, labels, seg, "sample")
    means = []
    for start, n in ((0, 3), (3, 6)):
        part = weighted_token_loss(logits[:, start:start + n], labels[:, start:start + n], seg[:, start:start + n],
                                   "token")
        means.append(float(part.weighted_sum / part.weight_total))
    assert float(packed.weighted_sum / packed.weight_total) == pytest.approx(sum(means) / 2, rel=1e-6)


def test_unknown_reduction_names_the_key():
    seg, labels = segments_and_labels([[3]], 3)
    with pytest.raises(ValueError, match="train.loss_reduction='mean' is invalid"):
        token_weights(labels, seg, "mean")


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_an_all_padding_row_one_token_wide_weighs_nothing(reduction):
    """The row that keeps a short rank in step collates to width 1: no target, zero weight, zero loss."""
    seg, labels = torch.full((1, 1), -1), torch.full((1, 1), IGNORE_INDEX)
    part = weighted_token_loss(torch.randn(1, 1, VOCAB), labels, seg, reduction)
    assert float(part.weight_total) == 0 and float(part.weighted_sum) == 0
