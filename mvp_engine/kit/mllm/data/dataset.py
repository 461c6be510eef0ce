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

from .assembler import MLLMPackingAssembler, OverlongSampleError
from .media import MLLMMediaHandler
from .pack import MLLMPack
from .sample import MLLMRecord, MLLMSampleEncoder, SampleMeta
from .sources import read_records
from .spec import MLLMDataSpec
from .steps import estimate_total_steps, micro_batches_per_rank, packs_per_rank


@dataclass
class EpochPlan:
    """One epoch's packs as record indices, the packed length of each record, and the drops by record."""

    epoch: int
    packs: list[list[int]]
    lengths: dict[int, int]
    dropped: dict[int, str]

    @property
    def drop_counts(self) -> Counter:
        return Counter(self.dropped.values())


class _PackedDatasetBase:
    """What both dataset kinds share: records, cached metadata, planning, rank split, pack encoding."""

    def __init__(self, records: list[MLLMRecord], encoder: MLLMSampleEncoder, data_spec: MLLMDataSpec,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 media_handler: MLLMMediaHandler | None = None):
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
        self.epoch = 0
        self._plans: dict[int, EpochPlan] = {}

    @cached_property
    def metas(self) -> list[SampleMeta]:
        """Lengths and media counts of every record, read from text and image headers only."""
        return [self.encoder.measure(record) for record in self.records]

    def record_order(self, epoch: int) -> list[int]:
        if not self.data_spec.shuffle:
            return list(range(len(self.records)))
        return np.random.default_rng([self.data_spec.seed, epoch]).permutation(len(self.records)).tolist()

    def plan(self, epoch: int | None = None) -> EpochPlan:
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._plans:
            order = self.record_order(epoch)
            metas = [self.metas[i] for i in order]
            try:
                plan = self.assembler.plan_with_report([m.length for m in metas], [m.num_media for m in metas],
                                                       [m.media_end for m in metas], epoch=epoch)
            except OverlongSampleError as err:
                record = self.records[order[err.index]]
                raise ValueError(f"{record.origin}: record {record.record_id!r} has {err.length} tokens > "
                                 f"max_seq_len={self.packing_spec.max_seq_len} (overlong=error)") from None
            self._plans = {epoch: EpochPlan(
                epoch=epoch,
                packs=[[order[j] for j in pack] for pack in plan.packs],
                lengths={order[j]: plan.lengths[j] for pack in plan.packs for j in pack},
                dropped={order[j]: reason for j, reason in plan.dropped.items()},
            )}
        return self._plans[epoch]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rank_packs(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's packs; an empty list stands for an all-padding row that keeps ranks in step."""
        packs = self.plan(epoch).packs
        count = packs_per_rank(len(packs), self.world_size, self.drop_last)
        mine = packs[self.rank::self.world_size][:count]
        return mine + [[] for _ in range(count - len(mine))]

    def samples_left_out_by_drop_last(self, micro_batch_size: int, epoch: int | None = None) -> int:
        """Samples of the epoch that no rank trains on: with ``drop_last`` the packs past an even split across ranks
        and those of a rank's last partial micro-batch (0 without ``drop_last``)."""
        packs = self.plan(epoch).packs
        served = micro_batches_per_rank(len(packs), micro_batch_size, self.world_size, self.drop_last) \
            * micro_batch_size
        served_packs = {k for rank in range(self.world_size)
                        for k in range(rank, len(packs), self.world_size)[:served]}
        return sum(len(pack) for k, pack in enumerate(packs) if k not in served_packs)

    def encode_pack(self, record_indices: list[int], epoch: int | None = None) -> dict:
        lengths = self.plan(epoch).lengths
        samples = []
        for i in record_indices:
            record = self.records[i]
            sample = self.encoder.encode(record)
            if sample.length != self.metas[i].length:
                raise ValueError(f"{record.origin}: encoder.measure gave {self.metas[i].length} tokens but encode "
                                 f"produced {sample.length}; the encoder breaks the measure/encode contract")
            samples.append(sample.truncated(lengths[i]) if lengths[i] < sample.length else sample)
        return MLLMPack(samples, self.media_handler).to_model_inputs()

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
    def read_records(data_spec: MLLMDataSpec) -> list[MLLMRecord]:
        if not data_spec.sources:
            raise ValueError("data.sources is empty: give at least one JSON/JSONL file")
        return [record for source in data_spec.sources for record in read_records(source, data_spec.image_root)]

    @staticmethod
    def build_dataset(data_spec: MLLMDataSpec, encoder: MLLMSampleEncoder, rank: int = 0, world_size: int = 1,
                      drop_last: bool = False, records: list[MLLMRecord] | None = None,
                      media_handler: MLLMMediaHandler | None = None) -> MLLMPackedDataset | MLLMStreamingPackedDataset:
        records = MLLMDataKit.read_records(data_spec) if records is None else records
        packing = data_spec.packing
        streaming = packing is not None and packing.assembler_cls is None and (
            packing.strategy == "greedy" or packing.buffer_size < len(records))
        cls = MLLMStreamingPackedDataset if streaming else MLLMPackedDataset
        return cls(records, encoder, data_spec, rank=rank, world_size=world_size, drop_last=drop_last,
                   media_handler=media_handler)

