"""``train.time_barrier``'s gradient averaging (``engine.grad_buckets``) goes a bucket at a time: the same averaged
gradients as an all-reduce of every gradient (what the one flat all-reduce of all of them gave, for one dtype),
without the flat copy (extra memory: one bucket)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mvp_engine.engine.grad_buckets import all_reduce_mean
from mvp_engine.engine.testkit.runs import run_on_ranks

BUCKET = 16 * 1024  # bytes: 4096 fp32 elements


def _gradients(rank: int) -> list[torch.Tensor]:
    """Per rank its own values: fp32 below, at and above a bucket, an fp64 one, a non-contiguous one."""
    generator = torch.Generator().manual_seed(rank)
    shapes = [(3000,), (10,), (4096,), (70, 90), (5,), (2000,), (33, 17)]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    grads.insert(3, torch.randn(40, generator=generator, dtype=torch.float64))
    grads.append(torch.randn(64, 64, generator=generator).t())  # 16 KiB, but a transposed view
    return grads


def _on_rank(rank: int) -> dict:
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        grads, expected = _gradients(rank), [g.contiguous() for g in _gradients(rank)]
        for g in expected:  # the mean in each gradient's own dtype, as one flat all-reduce of one dtype gives it
            dist.all_reduce(g)
            g /= world
        pointers, calls = {g.data_ptr() for g in grads}, []
        all_reduce = dist.all_reduce

        def recording(tensor, *args, **kwargs):
            calls.append((tensor.numel() * tensor.element_size(), tensor.data_ptr() in pointers))
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = recording
        try:
            all_reduce_mean(grads, world, bucket_bytes=BUCKET)
        finally:
            dist.all_reduce = all_reduce
        return {"equal": all(torch.equal(g, e) for g, e in zip(grads, expected)), "calls": calls,
                "total": sum(g.numel() * g.element_size() for g in grads)}
    finally:
        dist.destroy_process_group()


@pytest.mark.launch
def test_bucketed_averaging_equals_all_reducing_every_gradient_with_a_bucket_of_extra_memory():
    for result in run_on_ranks(2, _on_rank):
        assert result["equal"]
        # a gradient of a bucket or more is reduced in place; every copy is at most a bucket
        assert all(in_place or nbytes <= BUCKET for nbytes, in_place in result["calls"]), result["calls"]
        assert any(in_place for _, in_place in result["calls"]) and len(result["calls"]) > 3
        assert max(nbytes for nbytes, in_place in result["calls"] if not in_place) < result["total"] / 4
