"""Sharing the measure pass of shard sources out over ranks and their worker processes.

Every rank opens the same sources and needs every shard's measured table, but each shard should be measured once:
the work is a set of units (shards) with a cache entry each, claimed through the entry's file lock, which every
process on every node sharing the cache folder sees. A process visits the units in its own order: its share first
(rank ``r`` of ``N``: units ``r, r + N, r + 2N, ...``; its ``w``-th worker of ``W`` a ``W``-th of that), then the
rest, skipping an entry already complete and one another process holds, and comes back to those held until each is
complete. So with every process running, the shares are disjoint and even; a slow or stopped rank's share is taken
by the others instead of being waited for; and a warm start finds every entry complete and measures nothing.

The claim is not a collective (``torch.distributed``): a cold measure of millions of records takes longer than a
collective's timeout, and a file lock also shares the work between separate jobs on one cache.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable


def share_order(count: int, rank: int, world_size: int) -> list[int]:
    """Unit indices in the order rank ``rank`` visits them: its own share, then the next rank's, and so on."""
    return sorted(range(count), key=lambda i: ((i - rank) % world_size, i))


def worker_orders(order: list[int], share: int, workers: int) -> list[list[int]]:
    """``order`` (whose first ``share`` units are the rank's own) for each of ``workers`` processes: a ``workers``-th
    of the rank's share first, then every unit (those done are skipped)."""
    return [order[w:share:workers] + order for w in range(workers)]


def run_shares(claim: Callable[[list[int]], None], count: int, rank: int, world_size: int, workers: int) -> None:
    """``claim(order)`` over ``count`` units, in this process or, with several ``workers``, in as many forked
    processes (forked, not spawned: the units and the encoder are inherited, never pickled)."""
    order = share_order(count, rank, world_size)
    share = sum(1 for i in range(count) if i % world_size == rank)
    processes = min(workers, share)
    if processes <= 1:
        claim(order)
        return
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=claim, args=(own,), name=f"measure-{rank}-{w}")
                for w, own in enumerate(worker_orders(order, share, processes))]
    for child in children:
        child.start()
    for child in children:
        child.join()
    failed = [child.name for child in children if child.exitcode != 0]
    if failed:
        raise RuntimeError(f"measuring shards failed in worker process(es) {failed} (their error is above)")
