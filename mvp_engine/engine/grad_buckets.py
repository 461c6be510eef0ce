"""Averaging gradients over the ranks a bucket at a time, for ``train.time_barrier`` (which all-reduces after the last
backward itself instead of letting DDP overlap it with backward).

Why buckets: one flat copy of every gradient (``torch.cat``) doubles the gradients' memory at the step's peak (28 GB
for a 7B model in fp32); DDP itself all-reduces buckets of ``bucket_cap_mb`` (25 MB). Here gradients of at least a
bucket's size are all-reduced in place, the smaller ones packed into buckets of at most ``BUCKET_BYTES``, so the
extra memory is one bucket. Every rank lists its gradients in the same order (``model.parameters()``), so the ranks'
collectives pair up; each element is the same sum over the ranks whatever the bucketing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _average(bucket: list[torch.Tensor], world_size: int, group) -> None:
    if len(bucket) == 1 and bucket[0].is_contiguous():  # alone: in place, no copy
        dist.all_reduce(bucket[0], group=group)
        bucket[0].div_(world_size)
        return
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, group=group)
    flat /= world_size
    for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
        g.copy_(part.view_as(g))


def all_reduce_mean(grads: Sequence[torch.Tensor], world_size: int, bucket_bytes: int = BUCKET_BYTES,
                    group=None) -> None:
    """Replace each of ``grads`` by its mean over the ``world_size`` ranks of ``group``, in place: a gradient of
    ``bucket_bytes`` or more alone, the others in buckets of at most ``bucket_bytes`` of one dtype each."""
    bucket: list[torch.Tensor] = []
    for grad in grads:
        if _nbytes(grad) >= bucket_bytes:
            _average([grad], world_size, group)
            continue
        if bucket and (sum(map(_nbytes, bucket)) + _nbytes(grad) > bucket_bytes or grad.dtype != bucket[0].dtype):
            _average(bucket, world_size, group)
            bucket = []
        bucket.append(grad)
    if bucket:
        _average(bucket, world_size, group)
