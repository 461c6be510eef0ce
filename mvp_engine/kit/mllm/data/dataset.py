"""Datasets of packs: plan an epoch from metadata, then encode only the samples of the pack being served.

Both dataset kinds plan with the same ``MLLMPackingAssembler`` as the step estimate and the reports, so the
packs served are exactly the packs counted. Packs are split across ranks round-robin (pack k goes to rank
k mod world_size) and, inside a rank, across DataLoader workers the same way, so optimizer step s trains the plan's
packs [s x G, (s + 1) x G) for a global batch of G packs under any world size x micro-batch x accumulation: the data
position is a step count, which lets a run resume on another world size (tests/test_balance.py). Under
``packing.balance=compute`` the plan's packs are first reordered, window by window, so that each optimizer step gives
every rank a similar cost (``balance.py``; the counts per rank and the step count do not change).

Memory does not grow with Python objects per record: records stay in a memory-mapped :class:`RecordStore` (or a
small in-memory list), their measured metadata in numpy columns (:class:`SampleMetas`, cached on disk), and a plan
is either compact numpy offsets (map-style: any pack by index in O(1)) or, for a streaming strategy, not stored
at all: its pack count is counted once and the packs are replayed from the seeded planner when iterated.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import islice

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, get_worker_info

from .accounting import RecordLedger, SourceTally
from .assembler import Admission, MLLMPackingAssembler, OverlongSampleError
from .bad_records import BadRecord, BadRecordReport
from .balance import StepLayout, balance_rng, balanced_order
from .cost import CostProfile, pack_costs
from .measure import SampleMetas, default_cache_dir, encode_as_measured, measure_list, measure_store
from .media import MLLMMediaHandler
from .mixture import MLLMSource, epoch_draw
from .pack import MLLMPack
from .sample import IGNORE_INDEX, MLLMRecord, MLLMSampleEncoder
from .sources import MLLMRecordError, read_records
from .spec import MLLMDataSpec
from .steps import estimate_total_steps, micro_batches_per_rank, packs_per_rank
from .store import RecordStore


class PackArrays:
    """A stored plan: pack ``k`` is ``members[offsets[k]:offsets[k + 1]]`` (12 bytes a sample, not a list each)."""

    def __init__(self, groups: Iterator[list[int]]):
        offsets, members = array("q", [0]), array("q")
        for pack in groups:
            members.extend(pack)
            offsets.append(len(members))
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.members = np.frombuffer(members, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k: int) -> list[int]:
        if not 0 <= k < len(self):
            raise IndexError(f"pack {k} out of range for {len(self)} packs")
        return self.members[self.offsets[k]:self.offsets[k + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[k] for k in range(len(self)))


class ReplayedPacks:
    """A streaming plan that is not stored: ``len`` was counted once, iterating replays the seeded planner."""

    def __init__(self, replay: Callable[[], Iterator[list[int]]], count: int | None = None):
        self.replay = replay
        self.count = sum(1 for _ in replay()) if count is None else count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[list[int]]:
        return self.replay()


class RankPacks:
    """One rank's packs of an epoch (pack ``rank + j * world_size`` is its j-th), padded with empty packs (all-padding
    rows that keep ranks in step) to ``count``. Indexing is O(1) over a stored plan."""

    def __init__(self, packs: PackArrays | ReplayedPacks, rank: int, world_size: int, count: int):
        self.packs, self.rank, self.world_size, self.count = packs, rank, world_size, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, j: int) -> list[int]:
        if not 0 <= j < self.count:
            raise IndexError(f"rank pack {j} out of range for {self.count}")
        k = self.rank + j * self.world_size
        return self.packs[k] if k < len(self.packs) else []

    def __iter__(self) -> Iterator[list[int]]:
        mine = islice(self.packs, self.rank, None, self.world_size)
        served = 0
        for pack in islice(mine, self.count):
            served += 1
            yield pack
        for _ in range(self.count - served):
            yield []


@dataclass
class EpochPlan:
    """One epoch's packs as record indices, with the admission they were planned under: the packed length of
    each record (``lengths``), the drops by record and the records planned shorter than they are
    (``overlong=truncate``)."""

    epoch: int
    packs: PackArrays | ReplayedPacks
    admission: Admission

    @property
    def lengths(self) -> np.ndarray:
        return self.admission.lengths

    @property
    def dropped(self) -> dict[int, str]:
        return self.admission.dropped

    @property
    def drop_counts(self) -> Counter:
        return self.admission.drop_counts

    @property
    def truncated(self) -> frozenset[int]:
        return self.admission.truncated


class _PackedDatasetBase:
    """What both dataset kinds share: records, cached metadata, planning, rank split, pack encoding."""

    stores_plan = True  # map-style datasets index packs; streaming ones replay them

    def __init__(self, records: list[MLLMRecord] | RecordStore, encoder: MLLMSampleEncoder,
                 data_spec: MLLMDataSpec, rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 media_handler: MLLMMediaHandler | None = None, bad_records: BadRecordReport | None = None,
                 micro_batch_size: int = 1, gradient_accumulation_steps: int = 1,
                 cost_profile: CostProfile | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
        for name, value in (("micro_batch_size", micro_batch_size),
                            ("gradient_accumulation_steps", gradient_accumulation_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: allowed an int >= 1")
        self.records = records
        self.encoder = encoder
        self.data_spec = data_spec
        self.packing_spec = data_spec.effective_packing()
        self.assembler = MLLMPackingAssembler.from_spec(self.packing_spec)
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.media_handler = media_handler or MLLMMediaHandler()
        self.bad_records = bad_records or BadRecordReport(data_spec.on_bad_record, data_spec.max_bad_fraction)
        if not self.bad_records.records_read:
            self.bad_records.records_read = len(records)
        # the step shape and the cost model: what balancing needs (packs per rank per step, FLOPs per pack)
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.cost_profile = cost_profile
        self.sources, self.source_offsets = _mixture(records, data_spec)
        self.epoch = 0
        self._draws: dict[int, np.ndarray] = {}
        self._plans: dict[int, EpochPlan] = {}
        self._pack_counts: dict[int, int] = {}  # per epoch: a replayed plan is counted once, not at every replan
        self._left_out: dict[int, tuple[EpochPlan, frozenset[int]]] = {}

    @cached_property
    def metas(self) -> SampleMetas:
        """Lengths and media counts of every record, read from text and image headers only (and from the measure
        cache for a store); unusable for a record that cannot be measured, which goes to the bad-record report (or
        stops the run under ``error``)."""
        if isinstance(self.records, RecordStore):
            spec = self.data_spec
            return measure_store(self.records, self.encoder, self.bad_records, spec.cache_dir, spec.measure_workers,
                                 spec.measure_cache, rank=self.rank, world_size=self.world_size)
        return measure_list(self.records, self.encoder, self.bad_records)

    @cached_property
    def admission(self) -> Admission:
        """Which records every epoch may plan, and at what length (the same each epoch)."""
        metas = self.metas
        try:
            return self.assembler.admit(metas.length, metas.num_media, metas.media_end, metas.first_supervised,
                                        considered=metas.usable)
        except OverlongSampleError as err:
            record = self.records[err.index]
            raise MLLMRecordError(f"{record.origin}: record {record.record_id!r} has {err.length} tokens > "
                                  f"max_seq_len={self.packing_spec.max_seq_len} (overlong=error)", "overlong",
                                  record_id=record.record_id) from None

    def draw(self, epoch: int) -> np.ndarray:
        """Record indices the epoch draws from its sources (``mixture.epoch_draw``: a record of a ``repeat: 2``
        source twice), grouped by source; every record once when no source has a ``repeat``."""
        if epoch not in self._draws:
            self._draws = {epoch: epoch_draw(self.sources, self.source_offsets, self.data_spec.seed, epoch)}
        return self._draws[epoch]

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source number of each record index."""
        return np.searchsorted(self.source_offsets, indices, side="right") - 1

    def record_order(self, epoch: int) -> np.ndarray:
        draw = self.draw(epoch)
        if not self.data_spec.shuffle:
            return draw
        return draw[np.random.default_rng([self.data_spec.seed, epoch]).permutation(len(draw))]

    def _groups(self, epoch: int) -> Iterator[list[int]]:
        """The epoch's packs, planned afresh: records in the epoch's order, admitted ones only."""
        admission = self.admission
        order = self.record_order(epoch)
        order = order[admission.admitted_mask[order]]
        return self.assembler.iter_groups(order, admission.lengths, self.metas.num_media,
                                          self.assembler.rng(epoch))

    def plan(self, epoch: int | None = None) -> EpochPlan:
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._plans:
            admission = self.admission
            balance = self.packing_spec.balance == "compute"
            if self.stores_plan:
                packs = PackArrays(self._groups(epoch))
                if balance:
                    packs = PackArrays(self._balanced(packs, len(packs), epoch))
            else:
                packs = ReplayedPacks(lambda: self._groups(epoch), self._pack_counts.get(epoch))
                self._pack_counts[epoch] = count = len(packs)
                if balance:
                    packs = ReplayedPacks(lambda: self._balanced(self._groups(epoch), count, epoch), count)
            self._plans = {epoch: EpochPlan(epoch=epoch, packs=packs, admission=admission)}
        return self._plans[epoch]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def step_layout(self, num_packs: int, world_size: int | None = None) -> StepLayout:
        """How an epoch of ``num_packs`` packs maps to ranks and optimizer steps (what balancing evens out), at this
        dataset's world size or another (reports simulate ranks)."""
        world_size = world_size or self.world_size
        per_rank = self.micro_batch_size * self.gradient_accumulation_steps
        served = num_packs
        if self.drop_last:
            served = micro_batches_per_rank(num_packs, self.micro_batch_size, world_size, True) \
                * self.micro_batch_size * world_size
        return StepLayout(world_size, per_rank, served)

    def pack_costs(self, packs: list[list[int]]) -> np.ndarray:
        """Useful forward + backward FLOPs of each pack as its own row (``cost.pack_costs``), from the admission's
        packed lengths and the measured media columns alone: no model, no pixel."""
        if self.cost_profile is None:
            raise ValueError("packing.balance=compute needs the model's cost profile: pass cost_profile to "
                             "MLLMDataKit.build_dataset (the trainer and tools/pack_report.py do)")
        plan = PackArrays(iter(packs))
        metas = self.metas
        return pack_costs(self.cost_profile, plan.offsets, plan.members, self.admission.lengths,
                          metas.media_tokens, metas.media_sq, metas.num_media)

    def _balanced(self, packs, count: int, epoch: int) -> Iterator[list[int]]:
        """The epoch's packs reordered by ``balance.balanced_order`` (deterministic: seed, epoch, costs)."""
        return balanced_order(packs, self.step_layout(count), self.pack_costs, self.packing_spec.balance_window,
                              balance_rng(self.packing_spec.seed, epoch))

    def rank_packs(self, epoch: int | None = None) -> RankPacks:
        """This rank's packs; an empty list stands for an all-padding row that keeps ranks in step. A view over
        the epoch's plan: ``__getitem__`` asks for it on every item, so it must cost O(1), not a copy."""
        packs = self.plan(epoch).packs
        return RankPacks(packs, self.rank, self.world_size,
                         packs_per_rank(len(packs), self.world_size, self.drop_last))

    def _left_out_draws(self, micro_batch_size: int | None = None, epoch: int | None = None) -> np.ndarray:
        """Record indices of the epoch's packs that no rank trains on, once per draw: with ``drop_last`` the packs
        past an even split across ranks and those of a rank's last partial micro-batch (none without ``drop_last``).
        Every rank serves its first ``served`` packs, so these are the plan's packs from ``served * world_size`` on.
        Cached with the epoch's plan: the drop counts, the ledger and the dropped-records file all ask for it.

        ``micro_batch_size`` here and in the methods below: the dataset's own step shape unless given (the argument
        is kept for callers that still pass it)."""
        micro_batch_size = micro_batch_size or self.micro_batch_size
        plan = self.plan(epoch)
        cached = self._left_out.get(micro_batch_size)
        if cached is None or cached[0] is not plan:
            packs = plan.packs
            served = micro_batches_per_rank(len(packs), micro_batch_size, self.world_size, self.drop_last) \
                * micro_batch_size
            left = islice(packs, served * self.world_size, None) if served * self.world_size < len(packs) else ()
            cached = (plan, np.fromiter((i for pack in left for i in pack), dtype=np.int64))
            self._left_out = {micro_batch_size: cached}
        return cached[1]

    def left_out_by_drop_last(self, micro_batch_size: int | None = None, epoch: int | None = None) -> frozenset[int]:
        """Records of the epoch's packs that no rank trains on (see :meth:`_left_out_draws`)."""
        return frozenset(self._left_out_draws(micro_batch_size, epoch).tolist())

    def dropped_records(self, micro_batch_size: int | None = None, epoch: int | None = None) -> list[tuple[int, str]]:
        """``(record index, reason)`` of every draw the epoch plans not to train (bad records aside), by record
        index: one per draw, as :meth:`epoch_sources` counts them, so a record drawn twice (``repeat: 2``) and
        dropped is listed twice."""
        plan = self.plan(epoch)
        draw = self.draw(plan.epoch)
        reasons = plan.dropped
        dropped = [(i, reasons[i]) for i in draw[plan.admission.codes[draw] > 0].tolist()]
        dropped += [(i, "drop_last") for i in self._left_out_draws(micro_batch_size, plan.epoch).tolist()]
        return sorted(dropped)

    @cached_property
    def _bad_before_training(self) -> tuple[dict[int, str], Counter]:
        """The reason of each record found bad before training (by its origin in the report), and those without a
        record index (records the reader of an in-memory list already left out)."""
        report, usable = self.bad_records, self.metas.usable
        origin = self.records.origin if isinstance(self.records, RecordStore) else lambda i: self.records[i].origin
        reasons = {int(i): report.records[origin(int(i))].reason for i in np.flatnonzero(~usable)}
        return reasons, report.counts("read") + report.counts("measure") - Counter(reasons.values())

    def epoch_sources(self, micro_batch_size: int | None = None, epoch: int | None = None) -> list[SourceTally]:
        """Per source (``self.sources`` order), the epoch's draw as planned: records drawn, the draws dropped by the
        plan and by ``drop_last``, and the draws of records found bad before training, each by reason. The trainer
        adds what it trains and the faults found while decoding."""
        plan = self.plan(epoch)
        draw = self.draw(plan.epoch)
        counts = np.bincount(self.source_of(draw), minlength=len(self.sources))
        tallies = [SourceTally(records=int(n)) for n in counts]
        codes = plan.admission.codes
        dropped = draw[codes[draw] > 0]
        reasons = plan.dropped
        for i, s in zip(dropped.tolist(), self.source_of(dropped).tolist()):
            tallies[s].dropped[reasons[i]] += 1
        for s in self.source_of(self._left_out_draws(micro_batch_size, plan.epoch)).tolist():
            tallies[s].dropped["drop_last"] += 1
        bad, unindexed = self._bad_before_training
        found = draw[~self.metas.usable[draw]]
        for i, s in zip(found.tolist(), self.source_of(found).tolist()):
            tallies[s].bad[bad[i]] += 1
        tallies[0].records += sum(unindexed.values())
        tallies[0].bad.update(unindexed)
        return tallies

    def epoch_ledger(self, micro_batch_size: int | None = None, epoch: int | None = None) -> RecordLedger:
        """The epoch's record ledger as planned: the sum of :meth:`epoch_sources` (records drawn, drops, bad records
        found before training) and the draws truncated to fit."""
        plan = self.plan(epoch)
        tallies = self.epoch_sources(micro_batch_size, epoch)
        truncated = plan.admission.truncated_mask
        left_out = self._left_out_draws(micro_batch_size, epoch)
        return RecordLedger(
            epoch=plan.epoch,
            records_read=sum(t.records for t in tallies),
            dropped=sum((t.dropped for t in tallies), Counter()),
            bad=sum((t.bad for t in tallies), Counter()),
            truncated=int(truncated[self.draw(plan.epoch)].sum()) - int(truncated[left_out].sum()),
        )

    def encode_pack(self, record_indices: list[int], epoch: int | None = None) -> dict:
        """The pack's model inputs plus ``bad_records``: samples whose decoding failed (a corrupt image body, a
        decompression bomb) or whose encode disagrees with its measure leave the pack, which is still served so
        every rank keeps in step; the trainer counts and reports them (this may run in a DataLoader worker, whose
        own report nobody would read), each with the number of its ``source``. ``source_counts`` is the pack's
        samples, effective tokens and supervised tokens per source (one row each), for the per-source summary."""
        lengths, measured = self.plan(epoch).lengths, self.metas.length
        sources = self.source_of(np.asarray(record_indices, dtype=np.int64)).tolist()
        return encode_samples(self.encoder, self.media_handler, len(self.sources),
                              ((self.records[i], measured[i], lengths[i], source)
                               for i, source in zip(record_indices, sources)))

    def estimate_total_steps(self, epochs: int, micro_batch_size: int | None = None,
                             gradient_accumulation_steps: int | None = None) -> int:
        """Optimizer steps of ``epochs`` epochs from ``start_epoch`` 0, planned epoch by epoch, in the dataset's
        own step shape unless another is given."""
        counts = [len(self.plan(epoch).packs) for epoch in range(epochs)]
        return estimate_total_steps(counts, micro_batch_size or self.micro_batch_size,
                                    gradient_accumulation_steps or self.gradient_accumulation_steps, self.world_size,
                                    self.drop_last)


def encode_samples(encoder: MLLMSampleEncoder, media_handler: MLLMMediaHandler, num_sources: int,
                   members: Iterator[tuple[MLLMRecord, int, int, int]]) -> dict:
    """One pack's model inputs from its ``(record, measured length, planned length, source number)`` members: what
    an indexed plan's pack and a stream's pack (``stream.py``) both encode. A sample whose decoding fails leaves the
    pack (``bad_records``, each with its ``source``); one planned shorter than it is gets truncated to its slot."""
    samples, bad, kept, segment_sources = [], [], [], []
    for record, measured, planned, source in members:
        try:
            sample = encode_as_measured(encoder, record, measured)
        except MLLMRecordError as err:
            bad.append({**BadRecord.from_error(err, "decode").to_dict(), "source": source})
            continue
        samples.append(sample.truncated(planned) if planned < sample.length else sample)
        kept.append(source)
        segment_sources.extend([source] * (len(sample.parts) or 1))  # a duplicated-prefix pair: two segments
    inputs = MLLMPack(samples, media_handler).to_model_inputs()
    inputs["bad_records"] = bad
    inputs["source_counts"] = _source_counts(torch.tensor(kept, dtype=torch.long), inputs, num_sources,
                                             torch.tensor(segment_sources, dtype=torch.long))
    return inputs


def _mixture(records: list[MLLMRecord] | RecordStore, spec: MLLMDataSpec) -> tuple[list[MLLMSource], np.ndarray]:
    """The sources a dataset draws from and where each one's records start: the spec's entries over a store; an
    in-memory list is one source read once (its reader dropped bad records, so rows no longer map to entries)."""
    entries = spec.source_entries()
    if isinstance(records, RecordStore):
        if len(entries) != len(records.sources):
            raise ValueError(f"data.sources has {len(entries)} entries for a record store of {len(records.sources)} "
                             "sources: open the store from the same spec (MLLMDataKit.open_store)")
        return entries, np.asarray(records.offsets, dtype=np.int64)
    if any(entry.repeat != 1 for entry in entries):
        raise ValueError("data.sources: a repeat needs the record store (MLLMDataKit.build_dataset without records=)")
    name = entries[0].name if len(entries) == 1 else "records"
    return [MLLMSource(path=name, name=name)], np.asarray([0, len(records)], dtype=np.int64)


def _source_counts(sources: torch.Tensor, inputs: dict, num_sources: int,
                   segment_sources: torch.Tensor | None = None) -> torch.Tensor:
    """``(num_sources, 3)``: samples, effective tokens, supervised tokens of one pack per source, from its segment
    ids and labels (the first label of each segment already ignored), ``sources``, each sample's source, and
    ``segment_sources``, each segment's (default: ``sources``, one segment per sample)."""
    tokens = (sources if segment_sources is None else segment_sources)[inputs["pack_segment_ids"]]
    supervised = tokens[inputs["labels"] != IGNORE_INDEX]
    return torch.stack([torch.bincount(t, minlength=num_sources) for t in (sources, tokens, supervised)], dim=1)


class MLLMPackedDataset(_PackedDatasetBase, Dataset):
    """Map-style: used when packing is off or planned offline over the whole data set."""

    def __len__(self) -> int:
        return len(self.rank_packs())

    def __getitem__(self, index: int) -> dict:
        return self.encode_pack(self.rank_packs()[index])

    def starting_at(self, packs_done: int) -> Dataset:
        """This rank's packs of the current epoch from ``packs_done`` on (a resumed run's position)."""
        return self if packs_done == 0 else Subset(self, range(packs_done, len(self)))


class MLLMStreamingPackedDataset(_PackedDatasetBase, IterableDataset):
    """Iterable: used by streaming strategies; resumable through ``state_dict`` / ``load_state_dict``."""

    stores_plan = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packs_consumed = 0
        # the DataLoader's batch size (the step shape's micro-batch), so workers hand out whole micro-batches
        self.worker_batch_size = self.micro_batch_size

    def __len__(self) -> int:
        return len(self.rank_packs())

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        start = self.packs_consumed
        for k, pack in enumerate(self.rank_packs()):
            # whole micro-batches per worker: the DataLoader batches inside each worker and interleaves them in
            # worker order, which then reproduces the single-process batches exactly
            if k >= start and ((k - start) // self.worker_batch_size) % workers == worker_id:
                self.packs_consumed = k + 1
                yield self.encode_pack(pack)
        self.packs_consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts at its first pack; ``load_state_dict`` is how to start mid-epoch."""
        if epoch != self.epoch:
            self.packs_consumed = 0
        super().set_epoch(epoch)

    def starting_at(self, packs_done: int) -> MLLMStreamingPackedDataset:
        """This rank's packs of the current epoch from ``packs_done`` on (a resumed run's position)."""
        self.packs_consumed = packs_done
        return self

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "packs_consumed": self.packs_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.packs_consumed = int(state["packs_consumed"])


class MLLMDataKit:
    """Entry point: data spec + a recipe's encoder -> a dataset of packs (or single samples)."""

    @staticmethod
    def read_records(data_spec: MLLMDataSpec, bad_records: BadRecordReport | None = None) -> list[MLLMRecord]:
        """Every usable record of the sources as Python objects (tools over a few records; training reads a
        :class:`RecordStore`); with a report under ``on_bad_record=skip`` a bad record is recorded
        there and reading goes on, otherwise the first one raises (its message names ``file:line``)."""
        if not data_spec.sources:
            raise ValueError("data.sources is empty: give at least one JSON/JSONL file")
        on_bad = None
        if bad_records is not None and bad_records.policy == "skip":
            def on_bad(err: MLLMRecordError) -> None:
                bad_records.add_error(err, "read")
        records = [record for source in data_spec.source_entries()
                   for record in read_records(source.path, source.image_root or data_spec.image_root, on_bad=on_bad,
                                              allow_leading_assistant=data_spec.allow_leading_assistant,
                                              max_record_bytes=data_spec.max_record_bytes,
                                              media_roots=data_spec.media_roots)]
        if bad_records is not None:
            bad_records.records_read = len(records) + bad_records.count
        return records

    @staticmethod
    def open_store(data_spec: MLLMDataSpec) -> RecordStore:
        """The sources as one memory-mapped :class:`RecordStore` (JSON/JSONL converted once into the cache)."""
        if not data_spec.sources:
            raise ValueError("data.sources is empty: give at least one JSON/JSONL/parquet file or saved data set")
        entries = data_spec.source_entries()
        return RecordStore.open([e.path for e in entries], data_spec.cache_dir or default_cache_dir(),
                                data_spec.image_root, data_spec.allow_leading_assistant,
                                image_roots=[e.image_root for e in entries],
                                max_record_bytes=data_spec.max_record_bytes, media_roots=data_spec.media_roots)

    @staticmethod
    def build_dataset(data_spec: MLLMDataSpec, encoder: MLLMSampleEncoder, rank: int = 0, world_size: int = 1,
                      drop_last: bool = False, records: list[MLLMRecord] | RecordStore | None = None,
                      media_handler: MLLMMediaHandler | None = None,
                      bad_records: BadRecordReport | None = None, micro_batch_size: int = 1,
                      gradient_accumulation_steps: int = 1,
                      cost_profile: CostProfile | None = None, max_steps: int | None = None):
        """The dataset of packs over the spec's sources (a :class:`RecordStore`), or over ``records`` when given;
        ``bad_records`` collects the records left out (made from the spec's policy when not given, and reachable
        as ``dataset.bad_records``). ``micro_batch_size``, ``gradient_accumulation_steps`` and ``cost_profile`` (the
        model's, ``mvp_engine.engine.flops.cost_profile``) are what ``packing.balance=compute`` needs: the packs of
        one optimizer step and the cost of each.

        ``data_spec.streaming``: the stream mode's dataset (``stream.MLLMStreamDataset``), ``max_steps`` optimizer
        steps long, over the sources read in order (``records`` unused: nothing is indexed)."""
        bad_records = bad_records or BadRecordReport(data_spec.on_bad_record, data_spec.max_bad_fraction)
        if data_spec.streaming:
            from .stream import MLLMStreamDataset  # it encodes with this module's encode_samples

            return MLLMStreamDataset(data_spec, encoder, max_steps, rank=rank, world_size=world_size,
                                     micro_batch_size=micro_batch_size,
                                     gradient_accumulation_steps=gradient_accumulation_steps,
                                     media_handler=media_handler, bad_records=bad_records)
        records = MLLMDataKit.open_store(data_spec) if records is None else records
        packing = data_spec.packing
        streaming = packing is not None and packing.assembler_cls is None and (
            packing.strategy == "greedy" or packing.buffer_size < len(records))
        cls = MLLMStreamingPackedDataset if streaming else MLLMPackedDataset
        return cls(records, encoder, data_spec, rank=rank, world_size=world_size, drop_last=drop_last,
                   media_handler=media_handler, bad_records=bad_records, micro_batch_size=micro_batch_size,
                   gradient_accumulation_steps=gradient_accumulation_steps, cost_profile=cost_profile)
