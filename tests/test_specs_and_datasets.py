"""Spec validation messages, custom assemblers end to end, dataset kinds, resume and rank sharding."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.kit.mllm.data import (
    MLLMCollator,
    MLLMDataKit,
    MLLMDataSpec,
    MLLMPackedDataset,
    MLLMPackingAssembler,
    MLLMPackingSpec,
    MLLMStreamingPackedDataset,
)
from tests.fakes import FakeEncoder, fake_record


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_seq_len": 0}, "packing.max_seq_len=0 is invalid: allowed an int >= 1"),
    ({"strategy": "zigzag"},
     "packing.strategy='zigzag' is invalid: allowed one of ['greedy', 'bfd'] (or set assembler_cls)"),
    ({"max_open_packs": 0}, "packing.max_open_packs=0 is invalid: allowed an int >= 1"),
    ({"buffer_size": -3}, "packing.buffer_size=-3 is invalid: allowed an int >= 1"),
    ({"max_media_per_pack": 0}, "packing.max_media_per_pack=0 is invalid: allowed null or an int >= 1"),
    ({"max_samples_per_pack": 0}, "packing.max_samples_per_pack=0 is invalid: allowed null or an int >= 1"),
    ({"overlong": "wrap"}, "packing.overlong='wrap' is invalid: allowed one of ['drop', 'error', 'truncate']"),
    ({"seed": -1}, "packing.seed=-1 is invalid: allowed an int >= 0"),
    ({"assembler_cls": 3}, "packing.assembler_cls=3 is invalid: allowed null, a dotted path or a class"),
])
def test_packing_spec_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        MLLMPackingSpec(**kwargs)
    assert str(err.value) == message


def test_assembler_cls_errors_name_the_key():
    with pytest.raises(ValueError, match=r"packing.assembler_cls='no.such.Thing' cannot be imported"):
        MLLMPackingAssembler.from_spec(MLLMPackingSpec(assembler_cls="no.such.Thing"))
    with pytest.raises(ValueError, match="is not a MLLMPackingAssembler subclass"):
        MLLMPackingAssembler.from_spec(MLLMPackingSpec(assembler_cls="collections.Counter"))


class NextFitAssembler(MLLMPackingAssembler):
    """A custom algorithm: next-fit in stream order (one open pack)."""

    def group(self, order, lengths, media_counts, rng):
        packs, current, used = [], [], 0
        for i in order:
            if current and used + lengths[i] > self.spec.max_seq_len:
                packs.append(current)
                current, used = [], 0
            current.append(i)
            used += lengths[i]
        return packs + ([current] if current else [])


@pytest.mark.parametrize("cls", [NextFitAssembler, "tests.test_specs_and_datasets.NextFitAssembler"])
def test_custom_assembler_end_to_end(cls):
    lengths = [5, 4, 3, 6, 2, 6, 2]  # every sample >= 2 tokens: a 1-token sample has no target (dropped)
    records = [fake_record(i, n) for i, n in enumerate(lengths)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=10, assembler_cls=cls), shuffle=False)
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
    assert isinstance(dataset.assembler, NextFitAssembler)
    assert list(dataset.plan().packs) == [[0, 1], [2, 3], [4, 5, 6]]
    batch = MLLMCollator(pad_token_id=0)([dataset[k] for k in range(len(dataset))])
    assert batch["source_sample_num"].tolist() == [2, 2, 3]
    assert batch["input_ids"].shape == (3, 10)


def test_dataset_kind_follows_the_strategy():
    records = [fake_record(i, 5) for i in range(10)]

    def kind(packing):
        return type(MLLMDataKit.build_dataset(MLLMDataSpec(packing=packing), FakeEncoder(), records=records))

    assert kind(None) is MLLMPackedDataset
    assert kind(MLLMPackingSpec(strategy="bfd", buffer_size=100)) is MLLMPackedDataset
    assert kind(MLLMPackingSpec(strategy="bfd", buffer_size=4)) is MLLMStreamingPackedDataset
    assert kind(MLLMPackingSpec(strategy="greedy")) is MLLMStreamingPackedDataset


def test_streaming_dataset_resumes_where_it_stopped():
    records = [fake_record(i, 3 + i % 5) for i in range(40)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=12, strategy="greedy", buffer_size=8), seed=3)
    full = [row["sample_ids"] for row in MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)]
    first = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
    iterator = iter(first)
    head = [next(iterator)["sample_ids"] for _ in range(4)]
    state = first.state_dict()
    resumed = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
    resumed.load_state_dict(state)
    assert head + [row["sample_ids"] for row in resumed] == full


def test_ranks_split_packs_and_pad_short_ranks_with_empty_rows():
    records = [fake_record(i, 4) for i in range(7)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=4, strategy="bfd", buffer_size=100))
    ranks = [MLLMDataKit.build_dataset(spec, FakeEncoder(), rank=r, world_size=3, records=records) for r in range(3)]
    rows = [[ds[k] for k in range(len(ds))] for ds in ranks]
    assert [len(r) for r in rows] == [3, 3, 3]
    assert [row["source_sample_num"] for r in rows for row in r].count(0) == 2
    ids = sorted(i for r in rows for row in r for i in row["sample_ids"])
    assert ids == sorted(f"r{i}" for i in range(7))


def test_overlong_error_names_the_record():
    records = [fake_record(0, 5), fake_record(1, 50)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=10, overlong="error"))
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
    with pytest.raises(ValueError, match=r"fake.jsonl:2: record 'r1' has 50 tokens > max_seq_len=10"):
        dataset.plan()


def test_a_sample_whose_encode_disagrees_with_its_measure_is_a_bad_record_that_leaves_the_pack():
    """A media file rewritten after measuring (or an encoder bug) must not crash the step or shift the plan."""
    class LyingEncoder(FakeEncoder):
        def encode(self, record):
            sample = super().encode(record)
            if record.record_id == "r1":
                sample.input_ids, sample.labels = sample.input_ids[:-1], sample.labels[:-1]
            return sample

    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=10, strategy="bfd"))
    dataset = MLLMDataKit.build_dataset(spec, LyingEncoder(), records=[fake_record(0, 4), fake_record(1, 5)])
    pack = dataset[0]
    [bad] = pack["bad_records"]
    assert (bad["origin"], bad["reason"], bad["stage"]) == ("fake.jsonl:2", "measure_encode_mismatch", "decode")
    assert "encoder.measure gave 5 tokens but encode produced 4" in bad["message"]
    assert pack["input_ids"].shape[-1] == 4, "only r0 (4 tokens) stays in the pack"


def test_empty_sources_are_a_clear_error():
    with pytest.raises(ValueError, match="data.sources is empty"):
        MLLMDataKit.build_dataset(MLLMDataSpec(), FakeEncoder())


def test_dataloader_workers_reproduce_single_process_batches():
    records = [fake_record(i, 3 + i % 7) for i in range(60)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=16, strategy="greedy", buffer_size=8), seed=2)

    def batches(workers):
        dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
        dataset.worker_batch_size = 3
        loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=workers,
                                             collate_fn=MLLMCollator(pad_token_id=0))
        return [batch["sample_ids"] for batch in loader]

    single = batches(0)
    assert batches(2) == single
    assert len(single) == -(-len(MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)) // 3)


def test_new_epoch_starts_at_its_first_pack():
    records = [fake_record(i, 4) for i in range(20)]
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=8, strategy="greedy"))
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records)
    next(iter(dataset))
    dataset.set_epoch(1)
    assert len(list(dataset)) == len(dataset.rank_packs())
