"""Packing planners: group sample indices into packs from lengths and media counts alone.

One planner serves the dataset, the step estimate and the reports, so the packs a run trains on are exactly
the packs those tools counted. The inner loops are plain Python over ints on purpose: per-sample numpy calls
cost more than the work here (measured in ``tools/bench_packing.py``).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .spec import MLLMPackingSpec

DROP_OVERLONG = "overlong"
DROP_OVERLONG_MEDIA = "overlong_media_not_truncatable"
DROP_TOO_MANY_MEDIA = "too_many_media"
DROP_EMPTY = "empty"


class OverlongSampleError(ValueError):
    """Raised under ``overlong=error``; carries the offending sample index so callers can name the record."""

    def __init__(self, index: int, length: int, max_seq_len: int):
        super().__init__(f"sample #{index} has {length} tokens > packing.max_seq_len={max_seq_len} "
                         "(packing.overlong=error)")
        self.index = index
        self.length = length


@dataclass
class PackPlan:
    """A planned epoch: packs of sample indices, the length each sample is packed at, and the drops."""

    packs: list[list[int]]
    lengths: list[int]
    media_counts: list[int]
    dropped: dict[int, str] = field(default_factory=dict)
    truncated: list[int] = field(default_factory=list)

    @property
    def drop_counts(self) -> dict[str, int]:
        return dict(Counter(self.dropped.values()))

    def pack_lengths(self) -> list[int]:
        lengths = self.lengths
        return [sum(lengths[i] for i in pack) for pack in self.packs]


def _import_class(path: str) -> type:
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"packing.assembler_cls={path!r} cannot be imported: {err}") from err


class MLLMPackingAssembler:
    """Base planner: admits samples (overlong policy, media cap) and delegates grouping to ``group``.

    Subclasses implement ``group(order, lengths, media_counts, rng)`` returning packs of indices taken from
    ``order``; every index must land in exactly one pack and every pack must respect the spec's caps.
    ``MLLMPackingSpec(assembler_cls=...)`` plugs a subclass in.
    """

    def __init__(self, spec: MLLMPackingSpec):
        self.spec = spec

    @staticmethod
    def from_spec(spec: MLLMPackingSpec) -> MLLMPackingAssembler:
        cls = spec.assembler_cls
        if cls is None:
            cls = STRATEGY_CLASSES[spec.strategy]
        elif isinstance(cls, str):
            cls = _import_class(cls)
        if not (isinstance(cls, type) and issubclass(cls, MLLMPackingAssembler)):
            raise ValueError(f"packing.assembler_cls={spec.assembler_cls!r} is not a MLLMPackingAssembler subclass")
        return cls(spec)

    # -- planning -------------------------------------------------------------------------------------
    def plan(self, lengths: Sequence[int], media_counts: Sequence[int] | None = None,
             media_ends: Sequence[int] | None = None, epoch: int = 0) -> list[list[int]]:
        return self.plan_with_report(lengths, media_counts, media_ends, epoch).packs

    def plan_with_report(self, lengths: Sequence[int], media_counts: Sequence[int] | None = None,
                         media_ends: Sequence[int] | None = None, epoch: int = 0) -> PackPlan:
        lengths = [int(x) for x in lengths]
        media = [0] * len(lengths) if media_counts is None else [int(x) for x in media_counts]
        if len(media) != len(lengths):
            raise ValueError(f"media_counts has {len(media)} entries for {len(lengths)} lengths")
        plan = PackPlan(packs=[], lengths=lengths, media_counts=media)
        order = self._admit(plan, media_ends)
        rng = np.random.default_rng([self.spec.seed, epoch])
        plan.packs = self.group(order, plan.lengths, media, rng)
        return plan

    def _admit(self, plan: PackPlan, media_ends: Sequence[int] | None) -> list[int]:
        spec = self.spec
        cap = spec.max_seq_len
        media_cap = spec.max_media_per_pack
        order = []
        lengths = plan.lengths
        for i, length in enumerate(lengths):
            if length <= 0:
                plan.dropped[i] = DROP_EMPTY
                continue
            if media_cap is not None and plan.media_counts[i] > media_cap:
                plan.dropped[i] = DROP_TOO_MANY_MEDIA
                continue
            if length > cap:
                if spec.overlong == "error":
                    raise OverlongSampleError(i, length, cap)
                if spec.overlong == "truncate" and (media_ends is None or int(media_ends[i]) <= cap):
                    lengths[i] = cap
                    plan.truncated.append(i)
                else:
                    plan.dropped[i] = DROP_OVERLONG_MEDIA if spec.overlong == "truncate" else DROP_OVERLONG
                    continue
            order.append(i)
        return order

    def group(self, order: list[int], lengths: list[int], media_counts: list[int],
              rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError


class SingleSampleAssembler(MLLMPackingAssembler):
    """One sample per pack, in stream order: the unpacked baseline through the same admission rules."""

    def group(self, order, lengths, media_counts, rng):
        return [[i] for i in order]


def shuffle_buffer(order: list[int], buffer_size: int, rng: np.random.Generator) -> list[int]:
    """Seeded streaming shuffle: each incoming item swaps out a random slot of a ``buffer_size`` buffer."""
    if buffer_size <= 1 or len(order) <= 1:
        return list(order)
    buffer = list(order[:buffer_size])
    out = []
    slots = rng.integers(0, len(buffer), size=max(0, len(order) - len(buffer))).tolist()
    append = out.append
    for slot, item in zip(slots, order[len(buffer):]):
        append(buffer[slot])
        buffer[slot] = item
    out.extend(buffer[j] for j in rng.permutation(len(buffer)).tolist())
    return out


class GreedyAssembler(MLLMPackingAssembler):
    """Streaming first-fit over at most ``max_open_packs`` open packs; emits the fullest pack when stuck."""

    def group(self, order, lengths, media_counts, rng):
        spec = self.spec
        cap = spec.max_seq_len
        max_open = spec.max_open_packs
        media_cap = spec.max_media_per_pack
        count_cap = spec.max_samples_per_pack
        stream = shuffle_buffer(order, spec.buffer_size, rng)
        packs: list[list[int]] = []
        open_rem: list[int] = []  # remaining tokens per open pack, in opening order (first-fit order)
        open_items: list[list[int]] = []
        open_media: list[int] = []  # remaining media slots, only tracked under a media cap
        for i in stream:
            length = lengths[i]
            media = media_counts[i] if media_cap is not None else 0
            k = 0
            n_open = len(open_rem)
            while k < n_open:
                if open_rem[k] >= length and (media_cap is None or open_media[k] >= media):
                    break
                k += 1
            if k == n_open:
                if n_open >= max_open:
                    fullest = open_rem.index(min(open_rem))
                    packs.append(open_items.pop(fullest))
                    open_rem.pop(fullest)
                    if media_cap is not None:
                        open_media.pop(fullest)
                open_rem.append(cap - length)
                open_items.append([i])
                if media_cap is not None:
                    open_media.append(media_cap - media)
                k = len(open_rem) - 1
            else:
                open_rem[k] -= length
                open_items[k].append(i)
                if media_cap is not None:
                    open_media[k] -= media
            if open_rem[k] == 0 or (count_cap is not None and len(open_items[k]) >= count_cap):
                packs.append(open_items.pop(k))
                open_rem.pop(k)
                if media_cap is not None:
                    open_media.pop(k)
        packs.extend(open_items)
        return packs


class BestFitDecreasingAssembler(MLLMPackingAssembler):
    """Best-fit-decreasing over each ``buffer_size`` window; pack order shuffled so long packs do not cluster.

    Open packs sit in buckets keyed by remaining capacity; a Python int used as a bitset over those keys finds
    the tightest fitting bucket in a few big-int operations instead of a scan.
    """

    def group(self, order, lengths, media_counts, rng):
        spec = self.spec
        packs: list[list[int]] = []
        for start in range(0, len(order), spec.buffer_size):
            window = order[start:start + spec.buffer_size]
            window_packs = self._best_fit_decreasing(window, lengths, media_counts)
            packs.extend(window_packs[j] for j in rng.permutation(len(window_packs)).tolist())
        return packs

    def _best_fit_decreasing(self, window, lengths, media_counts):
        window_lengths = np.asarray([lengths[i] for i in window], dtype=np.int64)
        by_length = np.argsort(-window_lengths, kind="stable")
        ordered = np.asarray(window, dtype=np.int64)[by_length].tolist()
        if self.spec.max_media_per_pack is None and self.spec.max_samples_per_pack is None:
            run_starts = (np.flatnonzero(np.diff(window_lengths[by_length])) + 1).tolist()
            return self._bfd_by_runs(ordered, run_starts, lengths)
        return self._bfd_with_caps(ordered, lengths, media_counts)

    def _bfd_by_runs(self, ordered, run_starts, lengths):
        """BFD without count caps, placing each run of equal lengths in bulk.

        Open packs with equal remaining capacity are interchangeable, so a run of k items of length L goes
        to the tightest bucket r >= L, each pack there taking r // L items (after the first item it is still
        the tightest fit), before the next bucket is searched. Same packing quality as item-by-item BFD.
        """
        cap = self.spec.max_seq_len
        buckets: list[list[int]] = [[] for _ in range(cap + 1)]  # remaining capacity -> open pack ids
        occupied = 0  # bit r set <=> buckets[r] is non-empty
        items: list[list[int]] = []
        bounds = [0, *run_starts, len(ordered)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            length = lengths[ordered[start]]
            pos = start
            while pos < end:
                left = end - pos
                candidates = occupied >> length
                if not candidates:
                    per_pack = cap // length
                    for first in range(pos, end, per_pack):
                        chunk = ordered[first:min(first + per_pack, end)]
                        rem = cap - len(chunk) * length
                        if rem:
                            if not buckets[rem]:
                                occupied |= 1 << rem
                            buckets[rem].append(len(items))
                        items.append(chunk)
                    break
                r = length + (candidates & -candidates).bit_length() - 1
                bucket = buckets[r]
                per_pack = r // length
                n_full = min(len(bucket), left // per_pack)
                if n_full == 0:  # fewer items left than one pack can take: one pack takes them all
                    moved, take = [bucket.pop()], left
                else:
                    moved, take = bucket[-n_full:], per_pack
                    del bucket[-n_full:]
                if not bucket:
                    occupied ^= 1 << r
                if take == 1:
                    for pack_id, item in zip(moved, ordered[pos:pos + len(moved)]):
                        items[pack_id].append(item)
                else:
                    for j, pack_id in enumerate(moved):
                        items[pack_id].extend(ordered[pos + j * take:pos + (j + 1) * take])
                pos += take * len(moved)
                rem = r - take * length
                if rem:
                    if not buckets[rem]:
                        occupied |= 1 << rem
                    buckets[rem].extend(moved)
        return items

    def _bfd_with_caps(self, ordered, lengths, media_counts):
        """Item-by-item BFD honouring media and sample-count caps."""
        spec = self.spec
        cap = spec.max_seq_len
        media_cap = spec.max_media_per_pack
        count_cap = spec.max_samples_per_pack
        buckets: list[list[int]] = [[] for _ in range(cap + 1)]
        occupied = 0
        items: list[list[int]] = []
        rem_media: list[int] = []
        for i in ordered:
            length = lengths[i]
            media = media_counts[i]
            chosen = -1
            candidates = occupied >> length
            while candidates:
                low = candidates & -candidates
                r = length + low.bit_length() - 1
                bucket = buckets[r]
                for pos in range(len(bucket) - 1, -1, -1):
                    if media_cap is None or rem_media[bucket[pos]] >= media:
                        chosen = bucket.pop(pos)
                        break
                if chosen >= 0:
                    if not bucket:
                        occupied ^= 1 << r
                    new_rem = r - length
                    break
                candidates ^= low
            if chosen < 0:
                chosen = len(items)
                items.append([])
                rem_media.append(media_cap if media_cap is not None else 0)
                new_rem = cap - length
            items[chosen].append(i)
            rem_media[chosen] -= media
            full = new_rem == 0 or (count_cap is not None and len(items[chosen]) >= count_cap)
            if not full:
                if not buckets[new_rem]:
                    occupied |= 1 << new_rem
                buckets[new_rem].append(chosen)
        return items


STRATEGY_CLASSES: dict[str, type[MLLMPackingAssembler]] = {
    "greedy": GreedyAssembler,
    "bfd": BestFitDecreasingAssembler,
}
