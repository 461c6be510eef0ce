"""Datasets of packs: plan an epoch from metadata, then encode only the samples of the pack being served.

Both dataset kinds plan with the same ``MLLMPackingAssembler`` as the step estimate and the reports, so the
packs served are exactly the packs counted. Packs are split across ranks round-robin (pack k goes to rank
k mod world_size) and, inside a rank, across DataLoader workers the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from torch.utils.data import Dataset, IterableDataset, Subset, get_worker_info

from .accounting import RecordLedger
from .assembler import MLLMPackingAssembler, OverlongSampleError
from .bad_records import BadRecord, BadRecordReport
from .media import MLLMMediaHandler
from .pack import MLLMPack
from .sample import MLLMRecord, MLLMSampleEncoder, SampleMeta
from .sources import MLLMRecordError, read_records
from .spec import MLLMDataSpec
from .steps import estimate_total_steps, micro_batches_per_rank, packs_per_rank


@dataclass
class EpochPlan:
    """One epoch's packs as record indices, the packed length of each record, the drops by record, and the records
    planned shorter than they are (``overlong=truncate``)."""

    epoch: int
    packs: list[list[int]]
    lengths: dict[int, int]
    dropped: dict[int, str]
    truncated: frozenset[int] = frozenset()

    @property
    def drop_counts(self) -> Counter:
        return Counter(self.dropped.values())


class _PackedDatasetBase:
    """What both dataset kinds share: records, cached metadata, planning, rank split, pack encoding."""

    def __init__(self, records: list[MLLMRecord], encoder: MLLMSampleEncoder, data_spec: MLLMDataSpec,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 media_handler: MLLMMediaHandler | None = None, bad_records: BadRecordReport | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
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
        self.epoch = 0
        self._plans: dict[int, EpochPlan] = {}
        self._rank_packs: dict[int, tuple[EpochPlan, list[list[int]]]] = {}
        self._left_out: dict[int, tuple[EpochPlan, frozenset[int]]] = {}

    @cached_property
    def metas(self) -> list[SampleMeta | None]:
        """Lengths and media counts of every record, read from text and image headers only; None for a record
        that cannot be measured, which goes to the bad-record report (or stops the run under ``error``)."""
        return [self._measure(record) for record in self.records]

    def _measure(self, record: MLLMRecord) -> SampleMeta | None:
        try:
            return self.encoder.measure(record)
        except MLLMRecordError as err:
            self.bad_records.add_error(err, "measure")
            return None

    def record_order(self, epoch: int) -> list[int]:
        if not self.data_spec.shuffle:
            return list(range(len(self.records)))
        return np.random.default_rng([self.data_spec.seed, epoch]).permutation(len(self.records)).tolist()

    def plan(self, epoch: int | None = None) -> EpochPlan:
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._plans:
            order = [i for i in self.record_order(epoch) if self.metas[i] is not None]
            metas = [self.metas[i] for i in order]
            try:
                plan = self.assembler.plan_with_report([m.length for m in metas], [m.num_media for m in metas],
                                                       [m.media_end for m in metas], epoch=epoch)
            except OverlongSampleError as err:
                record = self.records[order[err.index]]
                raise MLLMRecordError(f"{record.origin}: record {record.record_id!r} has {err.length} tokens > "
                                      f"max_seq_len={self.packing_spec.max_seq_len} (overlong=error)", "overlong",
                                      record_id=record.record_id) from None
            self._plans = {epoch: self._without_untrainable(epoch, order, metas, plan)}
        return self._plans[epoch]

    @staticmethod
    def _without_untrainable(epoch: int, order: list[int], metas: list[SampleMeta], plan) -> EpochPlan:
        """The plan in record indices, minus samples a truncation left with no supervised token: they would train
        nothing yet count as samples, so they are dropped here, at plan time, where step counts are still exact."""
        dropped = {order[j]: reason for j, reason in plan.dropped.items()}
        packs = []
        for pack in plan.packs:
            kept = []
            for j in pack:
                if plan.lengths[j] <= metas[j].first_supervised:
                    dropped[order[j]] = "no_supervised_tokens"
                else:
                    kept.append(j)
            if kept:
                packs.append(kept)
        return EpochPlan(
            epoch=epoch,
            packs=[[order[j] for j in pack] for pack in packs],
            lengths={order[j]: plan.lengths[j] for pack in packs for j in pack},
            dropped=dropped,
            truncated=frozenset(order[j] for pack in packs for j in pack if plan.lengths[j] < metas[j].length),
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rank_packs(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's packs; an empty list stands for an all-padding row that keeps ranks in step. Cached with
        the epoch's plan: ``__getitem__`` asks for it on every item, and recomputing it there made an epoch
        quadratic in the data set size."""
        plan = self.plan(epoch)
        cached = self._rank_packs.get(plan.epoch)
        if cached is None or cached[0] is not plan:
            packs = plan.packs
            count = packs_per_rank(len(packs), self.world_size, self.drop_last)
            mine = packs[self.rank::self.world_size][:count]
            cached = (plan, mine + [[] for _ in range(count - len(mine))])
            self._rank_packs = {plan.epoch: cached}
        return cached[1]

    def left_out_by_drop_last(self, micro_batch_size: int, epoch: int | None = None) -> frozenset[int]:
        """Records of the epoch's packs that no rank trains on: with ``drop_last`` the packs past an even split
        across ranks and those of a rank's last partial micro-batch (none without ``drop_last``). Cached with the
        epoch's plan: the drop counts, the ledger and the dropped-records file all ask for it."""
        plan = self.plan(epoch)
        cached = self._left_out.get(micro_batch_size)
        if cached is None or cached[0] is not plan:
            packs = plan.packs
            served = micro_batches_per_rank(len(packs), micro_batch_size, self.world_size, self.drop_last) \
                * micro_batch_size
            served_packs = {k for rank in range(self.world_size)
                            for k in range(rank, len(packs), self.world_size)[:served]}
            cached = (plan, frozenset(i for k, pack in enumerate(packs) if k not in served_packs for i in pack))
            self._left_out = {micro_batch_size: cached}
        return cached[1]

    def dropped_records(self, micro_batch_size: int, epoch: int | None = None) -> dict[int, str]:
        """Record index -> reason of every record the epoch plans not to train (bad records aside)."""
        dropped = dict(self.plan(epoch).dropped)
        dropped.update((i, "drop_last") for i in self.left_out_by_drop_last(micro_batch_size, epoch))
        return dropped

    def epoch_ledger(self, micro_batch_size: int, epoch: int | None = None) -> RecordLedger:
        """The epoch's record ledger as planned: records read, drops and truncations by the plan, bad records
        found before training. The trainer adds what it trains and the faults found while decoding."""
        plan = self.plan(epoch)
        report = self.bad_records
        return RecordLedger(
            epoch=plan.epoch,
            records_read=report.records_read,
            dropped=Counter(self.dropped_records(micro_batch_size, epoch).values()),
            bad=report.counts("read") + report.counts("measure"),
            truncated=len(plan.truncated - self.left_out_by_drop_last(micro_batch_size, epoch)),
        )

    def encode_pack(self, record_indices: list[int], epoch: int | None = None) -> dict:
        """The pack's model inputs plus ``bad_records``: samples whose decoding failed (a corrupt image body, a
        decompression bomb) leave the pack, which is still served so every rank keeps in step; the trainer
        counts and reports them (this may run in a DataLoader worker, whose own report nobody would read)."""
        lengths = self.plan(epoch).lengths
        samples, bad = [], []
        for i in record_indices:
            record = self.records[i]
            try:
                sample = self.encoder.encode(record)
            except MLLMRecordError as err:
                bad.append(BadRecord.from_error(err, "decode").to_dict())
                continue
            if sample.length != self.metas[i].length:
                raise ValueError(f"{record.origin}: encoder.measure gave {self.metas[i].length} tokens but encode "
                                 f"produced {sample.length}; the encoder breaks the measure/encode contract")
            samples.append(sample.truncated(lengths[i]) if lengths[i] < sample.length else sample)
        inputs = MLLMPack(samples, self.media_handler).to_model_inputs()
        inputs["bad_records"] = bad
        return inputs

    def estimate_total_steps(self, epochs: int, micro_batch_size: int, gradient_accumulation_steps: int = 1) -> int:
        """Optimizer steps of ``epochs`` epochs from ``start_epoch`` 0, planned epoch by epoch."""
        counts = [len(self.plan(epoch).packs) for epoch in range(epochs)]
        return estimate_total_steps(counts, micro_batch_size, gradient_accumulation_steps, self.world_size,
                                    self.drop_last)


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packs_consumed = 0
        self.worker_batch_size = 1  # set to the DataLoader's batch size so workers hand out whole micro-batches

    def __len__(self) -> int:
        return len(self.rank_packs())

    def __iter__(self):
        packs = self.rank_packs()
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        start = self.packs_consumed
        for k in range(start, len(packs)):
            # whole micro-batches per worker: the DataLoader batches inside each worker and interleaves them in
            # worker order, which then reproduces the single-process batches exactly
            if ((k - start) // self.worker_batch_size) % workers == worker_id:
                self.packs_consumed = k + 1
                yield self.encode_pack(packs[k])
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
        """Every usable record of the sources; with a report under ``on_bad_record=skip`` a bad record is recorded
        there and reading goes on, otherwise the first one raises (its message names ``file:line``)."""
        if not data_spec.sources:
            raise ValueError("data.sources is empty: give at least one JSON/JSONL file")
        on_bad = None
        if bad_records is not None and bad_records.policy == "skip":
            def on_bad(err: MLLMRecordError) -> None:
                bad_records.add_error(err, "read")
        records = [record for source in data_spec.sources
                   for record in read_records(source, data_spec.image_root, on_bad=on_bad,
                                              allow_leading_assistant=data_spec.allow_leading_assistant)]
        if bad_records is not None:
            bad_records.records_read = len(records) + bad_records.count
        return records

    @staticmethod
    def build_dataset(data_spec: MLLMDataSpec, encoder: MLLMSampleEncoder, rank: int = 0, world_size: int = 1,
                      drop_last: bool = False, records: list[MLLMRecord] | None = None,
                      media_handler: MLLMMediaHandler | None = None,
                      bad_records: BadRecordReport | None = None) -> MLLMPackedDataset | MLLMStreamingPackedDataset:
        """The dataset of packs; ``bad_records`` collects the records left out (made from the spec's policy when
        not given, and reachable as ``dataset.bad_records``)."""
        bad_records = bad_records or BadRecordReport(data_spec.on_bad_record, data_spec.max_bad_fraction)
        records = MLLMDataKit.read_records(data_spec, bad_records) if records is None else records
        packing = data_spec.packing
        streaming = packing is not None and packing.assembler_cls is None and (
            packing.strategy == "greedy" or packing.buffer_size < len(records))
        cls = MLLMStreamingPackedDataset if streaming else MLLMPackedDataset
        return cls(records, encoder, data_spec, rank=rank, world_size=world_size, drop_last=drop_last,
                   media_handler=media_handler, bad_records=bad_records)
