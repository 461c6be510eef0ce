"""Packing planners: group sample indices into packs from lengths and media counts alone.

One planner serves the dataset, the step estimate and the reports, so the packs a run trains on are exactly
the packs those tools counted. Admission (which samples may be planned at all, and at what length) is one
vectorised pass over numpy columns; grouping is a generator of packs, so a streaming strategy's memory stays
flat in the data set size (the dataset replays it instead of storing it) and a whole-set plan can be stored
compactly as numpy offsets. The inner grouping loops are plain Python over ints on purpose: per-sample numpy
calls cost more than the work here (measured in ``tools/bench_packing.py``).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .spec import MLLMPackingSpec

DROP_OVERLONG = "overlong"
DROP_OVERLONG_MEDIA = "overlong_media_not_truncatable"
DROP_TOO_MANY_MEDIA = "too_many_media"
DROP_EMPTY = "empty"
DROP_NO_SUPERVISED = "no_supervised_tokens"
# Admission codes (0 = admitted), in the order the checks apply: a sample is dropped for the first that fails.
DROP_REASONS = ("", DROP_EMPTY, DROP_TOO_MANY_MEDIA, DROP_OVERLONG, DROP_OVERLONG_MEDIA, DROP_NO_SUPERVISED)
SHUFFLE_CHUNK = 1 << 16  # random slots drawn per batch by the streaming shuffle: bounded memory, few rng calls


class OverlongSampleError(ValueError):
    """Raised under ``overlong=error``; carries the offending sample index so callers can name the record."""

    def __init__(self, index: int, length: int, max_seq_len: int):
        super().__init__(f"sample #{index} has {length} tokens > packing.max_seq_len={max_seq_len} "
                         "(packing.overlong=error)")
        self.index = index
        self.length = length


@dataclass
class Admission:
    """Which samples may be planned and at what length: the same every epoch (lengths and caps only).

    ``lengths`` is each sample's packed length (``max_seq_len`` for a truncated one); ``codes`` its drop reason
    as an index into ``DROP_REASONS`` (0: admitted; also 0 for samples not considered, see ``considered``).
    Columns, not dicts: at ten million samples a dict entry per sample would cost gigabytes.
    """

    lengths: np.ndarray
    codes: np.ndarray
    truncated_mask: np.ndarray
    admitted_mask: np.ndarray

    @property
    def dropped(self) -> dict[int, str]:
        return {int(i): DROP_REASONS[self.codes[i]] for i in np.flatnonzero(self.codes)}

    @property
    def drop_counts(self) -> Counter:
        counts = np.bincount(self.codes, minlength=len(DROP_REASONS))
        return Counter({DROP_REASONS[code]: int(n) for code, n in enumerate(counts) if code and n})

    @property
    def truncated(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(self.truncated_mask).tolist())


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
    ``MLLMPackingSpec(assembler_cls=...)`` plugs a subclass in. The built-in strategies also implement
    ``iter_groups``, the same packs as a generator over numpy columns, which is what lets the dataset replay a
    streaming plan instead of storing it.
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
    def rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.spec.seed, epoch])

    def admit(self, lengths: Sequence[int], media_counts: Sequence[int] | None = None,
              media_ends: Sequence[int] | None = None, first_supervised: Sequence[int] | None = None,
              considered: np.ndarray | None = None) -> Admission:
        """Drop reasons and packed lengths of every sample, vectorised; ``considered`` (a bool mask) leaves samples
        out without a reason (records already reported as bad). A sample a truncation would leave with no
        supervised token (``first_supervised``, see :class:`SampleMeta`) is dropped here, so the packs and the
        step count never include a sample that trains nothing."""
        spec = self.spec
        cap = spec.max_seq_len
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        media = _column(media_counts, n)
        if len(media) != n:
            raise ValueError(f"media_counts has {len(media)} entries for {n} lengths")
        considered = np.ones(n, dtype=bool) if considered is None else np.asarray(considered, dtype=bool)
        codes = np.zeros(n, dtype=np.int8)
        open_ = considered.copy()

        def drop(mask: np.ndarray, reason: str) -> None:
            mask = mask & open_
            codes[mask] = DROP_REASONS.index(reason)
            open_[mask] = False

        drop(lengths <= 0, DROP_EMPTY)
        if spec.max_media_per_pack is not None:
            drop(media > spec.max_media_per_pack, DROP_TOO_MANY_MEDIA)
        overlong = open_ & (lengths > cap)
        truncated = np.zeros(n, dtype=bool)
        if spec.overlong == "error" and overlong.any():
            first = int(np.flatnonzero(overlong)[0])
            raise OverlongSampleError(first, int(lengths[first]), cap)
        if spec.overlong == "truncate":
            fits = np.ones(n, dtype=bool) if media_ends is None else _column(media_ends, n) <= cap
            truncated = overlong & fits
            drop(overlong & ~fits, DROP_OVERLONG_MEDIA)
        else:
            drop(overlong, DROP_OVERLONG)
        packed = np.where(truncated, cap, lengths)
        if first_supervised is not None:
            drop(packed <= _column(first_supervised, n), DROP_NO_SUPERVISED)
        truncated &= open_
        return Admission(lengths=packed, codes=codes, truncated_mask=truncated, admitted_mask=open_)

    def iter_groups(self, order: np.ndarray, lengths: np.ndarray, media_counts: np.ndarray,
                    rng: np.random.Generator) -> Iterator[list[int]]:
        """Packs of the indices in ``order`` (the stream), as ``group`` makes them; built-ins yield lazily."""
        yield from self.group(np.asarray(order).tolist(), np.asarray(lengths).tolist(),
                              np.asarray(media_counts).tolist(), rng)

    def group(self, order: list[int], lengths: list[int], media_counts: list[int],
              rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError


def _column(values: Sequence[int] | None, n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64) if values is None else np.asarray(values, dtype=np.int64)


class _LazyGroups:
    """``group`` of a built-in strategy: its ``iter_groups`` collected into a list."""

    def group(self, order, lengths, media_counts, rng):
        return list(self.iter_groups(np.asarray(order, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
                                     np.asarray(media_counts, dtype=np.int64), rng))


class SingleSampleAssembler(_LazyGroups, MLLMPackingAssembler):
    """One sample per pack, in stream order: the unpacked baseline through the same admission rules."""

    def iter_groups(self, order, lengths, media_counts, rng):
        for i in np.asarray(order).tolist():
            yield [i]


def shuffled_chunks(order: np.ndarray, buffer_size: int, rng: np.random.Generator,
                    chunk: int = SHUFFLE_CHUNK) -> Iterator[list[int]]:
    """Seeded streaming shuffle, chunk by chunk: each incoming item swaps out a random slot of a ``buffer_size``
    buffer. Only the buffer and one chunk are ever held, whatever the length of ``order``."""
    order = np.asarray(order)
    if buffer_size <= 1 or len(order) <= 1:
        for start in range(0, len(order), chunk):
            yield order[start:start + chunk].tolist()
        return
    buffer = order[:buffer_size].tolist()
    for start in range(len(buffer), len(order), chunk):
        incoming = order[start:start + chunk].tolist()
        slots = rng.integers(0, len(buffer), size=len(incoming)).tolist()
        out = []
        append = out.append
        for slot, item in zip(slots, incoming):
            append(buffer[slot])
            buffer[slot] = item
        yield out
    yield [buffer[j] for j in rng.permutation(len(buffer)).tolist()]


def shuffle_buffer(order: Sequence[int], buffer_size: int, rng: np.random.Generator) -> list[int]:
    """The whole stream of :func:`shuffled_chunks` as one list."""
    return [i for chunk in shuffled_chunks(np.asarray(order, dtype=np.int64), buffer_size, rng) for i in chunk]


class FirstFitPacks:
    """Streaming first-fit over at most ``max_open_packs`` open packs; emits the fullest pack when stuck.

    The greedy strategy's packer as an object, so that both the planner of an indexed epoch
    (:class:`GreedyAssembler`) and the stream mode (``stream.py``, which checkpoints the open packs' items) pack with
    the same code. Items are opaque (record indices, or a stream's record keys); ``open_items`` / ``open_rem`` /
    ``open_media`` are the whole state: the items of each open pack, its remaining tokens and media slots (the
    latter only tracked under a media cap), in opening order (first-fit order)."""

    def __init__(self, spec: MLLMPackingSpec, open_items=(), open_rem=(), open_media=()):
        self.cap, self.max_open = spec.max_seq_len, spec.max_open_packs
        self.media_cap, self.count_cap = spec.max_media_per_pack, spec.max_samples_per_pack
        self.open_items: list[list] = [list(items) for items in open_items]
        self.open_rem: list[int] = list(open_rem)
        self.open_media: list[int] = list(open_media)

    def add(self, item, length: int, media: int, out: list) -> None:
        """Place ``item`` (``length`` tokens, ``media`` items); the packs it completes are appended to ``out``."""
        open_rem, open_items, open_media, media_cap = self.open_rem, self.open_items, self.open_media, self.media_cap
        k = 0
        n_open = len(open_rem)
        while k < n_open:
            if open_rem[k] >= length and (media_cap is None or open_media[k] >= media):
                break
            k += 1
        if k == n_open:
            if n_open >= self.max_open:
                fullest = open_rem.index(min(open_rem))
                out.append(open_items.pop(fullest))
                open_rem.pop(fullest)
                if media_cap is not None:
                    open_media.pop(fullest)
            open_rem.append(self.cap - length)
            open_items.append([item])
            if media_cap is not None:
                open_media.append(media_cap - media)
            k = len(open_rem) - 1
        else:
            open_rem[k] -= length
            open_items[k].append(item)
            if media_cap is not None:
                open_media[k] -= media
        if open_rem[k] == 0 or (self.count_cap is not None and len(open_items[k]) >= self.count_cap):
            out.append(open_items.pop(k))
            open_rem.pop(k)
            if media_cap is not None:
                open_media.pop(k)


class GreedyAssembler(_LazyGroups, MLLMPackingAssembler):
    """Streaming first-fit (:class:`FirstFitPacks`) fed from the seeded shuffle buffer.

    A generator end to end (shuffle buffer, open packs): its memory is the buffer plus the open packs, flat in the
    data set size."""

    def iter_groups(self, order, lengths, media_counts, rng):
        packer = FirstFitPacks(self.spec)
        add, done = packer.add, []
        tracks_media = self.spec.max_media_per_pack is not None
        for chunk in shuffled_chunks(order, self.spec.buffer_size, rng):
            chunk_lengths = lengths[chunk].tolist()
            chunk_media = media_counts[chunk].tolist() if tracks_media else [0] * len(chunk)
            for i, length, media in zip(chunk, chunk_lengths, chunk_media):
                add(i, length, media, done)
                if done:
                    yield from done
                    done.clear()
        yield from packer.open_items


class BestFitDecreasingAssembler(_LazyGroups, MLLMPackingAssembler):
    """Best-fit-decreasing over each ``buffer_size`` window; pack order shuffled so long packs do not cluster.

    Open packs sit in buckets keyed by remaining capacity; a Python int used as a bitset over those keys finds
    the tightest fitting bucket in a few big-int operations instead of a scan. Windows are planned one at a time,
    so a windowed plan streams like greedy's.
    """

    def iter_groups(self, order, lengths, media_counts, rng):
        order = np.asarray(order, dtype=np.int64)
        for start in range(0, len(order), self.spec.buffer_size):
            window = order[start:start + self.spec.buffer_size]
            window_packs = self._best_fit_decreasing(window, lengths, media_counts)
            for j in rng.permutation(len(window_packs)).tolist():
                yield window_packs[j]

    def _best_fit_decreasing(self, window, lengths, media_counts):
        window_lengths = lengths[window]
        by_length = np.argsort(-window_lengths, kind="stable")
        ordered = window[by_length].tolist()
        sorted_lengths = window_lengths[by_length]
        if self.spec.max_media_per_pack is None and self.spec.max_samples_per_pack is None:
            run_starts = (np.flatnonzero(np.diff(sorted_lengths)) + 1).tolist()
            return self._bfd_by_runs(ordered, run_starts, sorted_lengths.tolist())
        return self._bfd_with_caps(ordered, sorted_lengths.tolist(), media_counts[window[by_length]].tolist())

    def _bfd_by_runs(self, ordered, run_starts, sorted_lengths):
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
            length = sorted_lengths[start]
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

    def _bfd_with_caps(self, ordered, sorted_lengths, sorted_media):
        """Item-by-item BFD honouring media and sample-count caps."""
        spec = self.spec
        cap = spec.max_seq_len
        media_cap = spec.max_media_per_pack
        count_cap = spec.max_samples_per_pack
        buckets: list[list[int]] = [[] for _ in range(cap + 1)]
        occupied = 0
        items: list[list[int]] = []
        rem_media: list[int] = []
        for i, length, media in zip(ordered, sorted_lengths, sorted_media):
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
