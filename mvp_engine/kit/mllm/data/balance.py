"""Packs balanced by compute across ranks: every rank waits for the slowest at each all-reduce.

Ranks serve the epoch's packs round-robin (pack ``k`` to rank ``k mod world_size``), so a global optimizer step is a
run of ``world_size x per_rank`` consecutive packs of the plan (``per_rank`` = micro-batch size x gradient
accumulation). ``packing.balance: compute`` keeps that rule and reorders the plan instead, one window of
``packing.balance_window`` steps at a time (a streaming plan stays streaming):

1. the window's packs are sorted by cost (useful FLOPs, ``cost.pack_costs``) and cut into steps, so each step holds
   packs of similar cost (with one pack per rank per step only this grouping can help);
2. the window's steps are shuffled (seeded by ``packing.seed`` and the epoch), so training order stays random;
3. inside each step the packs go to ranks by LPT (largest first, to the least loaded rank that still has room), every
   rank taking exactly ``per_rank`` packs: the largest per-rank cost is as small as the greedy rule makes it.

The partial step at the end of the served packs (ranks with all-padding rows under ``drop_last=false``) is assigned
by LPT too, each rank keeping its round-robin number of packs; packs ``drop_last`` leaves out stay where they are.
Counts per rank, the step count and determinism are untouched: only which pack sits where changes. ``balance: none``
leaves the plan as the planner made it.

:func:`imbalance` measures any order: per step, the largest per-rank cost over the mean per-rank cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from .spec import BALANCE_MODES  # noqa: F401  (re-exported: the modes live with the spec that validates them)

BALANCE_STREAM = 0x62616C  # a separate random stream: balancing never moves the planner's own draws


@dataclass(frozen=True)
class StepLayout:
    """How the plan's packs map to ranks and steps: ``world_size`` ranks, ``per_rank`` packs per rank per optimizer
    step, and ``served`` packs trained (the rest: left out by ``drop_last``)."""

    world_size: int
    per_rank: int
    served: int

    @property
    def step_packs(self) -> int:
        return self.world_size * self.per_rank

    @property
    def full_end(self) -> int:
        """Packs of the plan that fall in full steps: every rank has ``per_rank`` real packs."""
        return self.served // self.step_packs * self.step_packs


def balance_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, BALANCE_STREAM])


def balanced_order(packs: Iterable[list[int]], layout: StepLayout, costs: Callable[[list[list[int]]], np.ndarray],
                   window_steps: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """The plan's packs (``packs``, in planned order) reordered so each step's per-rank costs are even; lazy, one
    window of ``window_steps`` full steps in memory at a time. ``costs(packs)`` gives each pack's cost."""
    it = iter(packs)
    window = window_steps * layout.step_packs
    position = 0
    while position < layout.full_end:
        chunk = list(islice(it, min(window, layout.full_end - position)))
        yield from _balance_steps(chunk, costs(chunk), layout.world_size, layout.per_rank, rng)
        position += len(chunk)
    tail = list(islice(it, layout.served - layout.full_end))
    if tail:
        yield from _balance_tail(tail, costs(tail), layout.world_size)
    yield from it


def _lpt(items: Iterable[int], costs: np.ndarray, capacity: list[int]) -> list[list[int]]:
    """Items (already in decreasing cost) to bins: each to the least loaded bin with room (ties: the lowest bin)."""
    bins: list[list[int]] = [[] for _ in capacity]
    heap = [(0.0, b) for b, room in enumerate(capacity) if room > 0]
    heapq.heapify(heap)
    for item in items:
        load, b = heapq.heappop(heap)
        bins[b].append(item)
        if len(bins[b]) < capacity[b]:
            heapq.heappush(heap, (load + float(costs[item]), b))
    return bins


def _lay_out(chunk: list[list[int]], bins: list[list[int]], world_size: int) -> list[list[int]]:
    """Rank ``r``'s ``i``-th pack at position ``i * world_size + r``: what round-robin serving gives rank ``r``."""
    out: list[list[int]] = [[] for _ in range(sum(len(b) for b in bins))]
    for rank, items in enumerate(bins):
        for i, item in enumerate(items):
            out[i * world_size + rank] = chunk[item]
    return out


def _balance_steps(chunk: list[list[int]], costs: np.ndarray, world_size: int, per_rank: int,
                   rng: np.random.Generator) -> Iterator[list[int]]:
    step = world_size * per_rank
    by_cost = np.argsort(-costs, kind="stable")
    steps = [by_cost[j * step:(j + 1) * step].tolist() for j in range(len(chunk) // step)]
    for j in rng.permutation(len(steps)).tolist():
        yield from _lay_out(chunk, _lpt(steps[j], costs, [per_rank] * world_size), world_size)


def _balance_tail(tail: list[list[int]], costs: np.ndarray, world_size: int) -> list[list[int]]:
    capacity = [len(range(rank, len(tail), world_size)) for rank in range(world_size)]
    return _lay_out(tail, _lpt(np.argsort(-costs, kind="stable").tolist(), costs, capacity), world_size)


# --------------------------------------------------------------------------------------------- measurement


def step_rank_costs(costs: np.ndarray, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank cost of every step, ``(full, tail)``: arrays of shape (steps, world_size) for the full steps and for
    the partial step(s) after them (ranks with all-padding rows cost 0 there). ``costs[k]``: pack ``k``'s cost."""
    served = np.asarray(costs, dtype=np.float64)[:layout.served]
    k = np.arange(len(served))
    step = (k // layout.world_size) // layout.per_rank
    steps = int(step[-1]) + 1 if len(served) else 0
    table = np.zeros((steps, layout.world_size))
    np.add.at(table, (step, k % layout.world_size), served)
    full = layout.full_end // layout.step_packs
    return table[:full], table[full:]


def imbalance(table: np.ndarray) -> np.ndarray:
    """Per step: the largest per-rank cost over the mean per-rank cost (1.0 = perfectly even)."""
    mean = table.mean(axis=1)
    return np.divide(table.max(axis=1), mean, out=np.ones(len(table)), where=mean > 0)


def imbalance_summary(costs: np.ndarray, layout: StepLayout) -> dict:
    """Mean and 95th percentile of the per-step imbalance over the full steps; the tail apart."""
    full, tail = step_rank_costs(costs, layout)
    ratios, tail_ratios = imbalance(full), imbalance(tail)
    return {
        "world_size": layout.world_size,
        "packs_per_rank_per_step": layout.per_rank,
        "full_steps": len(full),
        "mean": float(ratios.mean()) if len(ratios) else None,
        "p95": float(np.percentile(ratios, 95)) if len(ratios) else None,
        "max": float(ratios.max()) if len(ratios) else None,
        "tail_steps": len(tail),
        "tail": [float(r) for r in tail_ratios],
        # the time every rank waits for the slowest, as a share of the steps' time if time follows cost
        "idle_fraction": float(1 - full.mean(axis=1).sum() / full.max(axis=1).sum()) if len(full) else None,
    }
