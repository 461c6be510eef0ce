"""The peak memory a piece of work adds on the CPU, counted from the profiler's allocation events.

Why here: the benchmarks under ``tools/`` that compare steps by their memory (``bench_memory.py``: the loss alone and
a whole step, full vs chunked; ``bench_pairs.py``: a DPO step packed shared vs duplicated vs unpacked) count it one
way, this one. On CUDA ``torch.cuda.max_memory_allocated`` says the same; the CPU allocator keeps no peak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_added_bytes(step: Callable[[], object]) -> int:
    """The most bytes allocated at once while ``step()`` runs, above what was allocated before it: every CPU
    allocation and free the profiler records (its raw ``[memory]`` events, each with its own time), added up in
    time order. Why not the ops' memory: an op's self memory nets the frees made in its span, and a free made by
    Python code inside a custom autograd function (a chunk's temporaries dropped) lands on that function's event,
    which starts before the allocations it nets, so per-op sums under-count such a peak."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=True) as profile:
        step()
    events = sorted((event.start_ns(), event.nbytes()) for event in profile.kineto_results.events()
                    if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
