"""Optimizer-step arithmetic shared by the run, the step estimate and the reports, so they cannot disagree."""

from __future__ import annotations

import math


def packs_per_rank(num_packs: int, world_size: int, drop_last: bool) -> int:
    """Packs each rank iterates: an even split; without ``drop_last`` short ranks get an all-padding row."""
    return num_packs // world_size if drop_last else math.ceil(num_packs / world_size)


def micro_batches_per_rank(num_packs: int, micro_batch_size: int, world_size: int = 1, drop_last: bool = False) -> int:
    per_rank = packs_per_rank(num_packs, world_size, drop_last)
    return per_rank // micro_batch_size if drop_last else math.ceil(per_rank / micro_batch_size)


def optimizer_steps(num_micro_batches: int, gradient_accumulation_steps: int) -> int:
    """A final partial accumulation still steps (its loss is normalised by its own token counts)."""
    return math.ceil(num_micro_batches / gradient_accumulation_steps)


def estimate_total_steps(packs_per_epoch: list[int], micro_batch_size: int, gradient_accumulation_steps: int = 1,
                         world_size: int = 1, drop_last: bool = False) -> int:
    """Total optimizer steps of a run whose epoch ``e`` holds ``packs_per_epoch[e]`` packs.

    ``MLLMPackedDataset.estimate_total_steps`` plans each epoch and calls this; use that unless you already
    hold the pack counts.
    """
    for name, value in (("micro_batch_size", micro_batch_size), ("world_size", world_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: allowed an int >= 1")
    return sum(
        optimizer_steps(micro_batches_per_rank(n, micro_batch_size, world_size, drop_last), gradient_accumulation_steps)
        for n in packs_per_epoch
    )
