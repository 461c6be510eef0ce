"""The bad-record policy in the DataKit: every record read ends up trained, dropped or bad, each with a reason."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mvp_engine.kit.mllm.data import (
    BadRecordReport,
    MLLMCollator,
    MLLMDataKit,
    MLLMDataSpec,
    MLLMPackingSpec,
    MLLMRecordError,
    TooManyBadRecords,
)
from tests.fakes import FakeEncoder, fake_record

MEDIUM = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dataset(records, strategy="greedy", max_seq_len=64, policy="skip", report=None, **kwargs):
    packing = None if strategy is None else MLLMPackingSpec(max_seq_len=max_seq_len, strategy=strategy,
                                                            overlong="truncate", buffer_size=16)
    spec = MLLMDataSpec(packing=packing, max_seq_len=max_seq_len, overlong="truncate", seed=1, on_bad_record=policy,
                        max_bad_fraction=1.0)
    return MLLMDataKit.build_dataset(spec, FakeEncoder(), records=records, bad_records=report, **kwargs)


def served_batches(ds, micro_batch_size):
    """The batches a DataLoader would give (the collator carries ``bad_records`` along)."""
    rows = list(ds) if hasattr(ds, "state_dict") else [ds[k] for k in range(len(ds))]
    collate = MLLMCollator(pad_token_id=0)
    batches = [rows[k:k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
    if ds.drop_last:
        batches = [b for b in batches if len(b) == micro_batch_size]
    return [collate(b) for b in batches]


@st.composite
def messy_records(draw):
    n = draw(st.integers(1, 40))
    records = []
    for i in range(n):
        media = draw(st.integers(0, 2))
        length = draw(st.integers(4 * media + 1, 100))
        fault = draw(st.sampled_from([None, None, None, "measure", "decode"]))
        records.append(fake_record(i, length, media, fault))
    return records


@MEDIUM
@given(records=messy_records(), strategy=st.sampled_from([None, "greedy", "bfd"]), world_size=st.integers(1, 3),
       micro_batch_size=st.integers(1, 3), drop_last=st.booleans(), epochs=st.integers(1, 2))
def test_records_read_equal_trained_plus_dropped_plus_bad_every_epoch(records, strategy, world_size,
                                                                      micro_batch_size, drop_last, epochs):
    ranks = [dataset(records, strategy, rank=r, world_size=world_size, drop_last=drop_last) for r in range(world_size)]
    for epoch in range(epochs):
        ledger = ranks[0].epoch_ledger(micro_batch_size, epoch)
        decoded_bad = Counter()
        for ds in ranks:
            ds.set_epoch(epoch)
            for batch in served_batches(ds, micro_batch_size):
                ledger.samples_trained += int(batch["source_sample_num"].sum())  # counted, not subtracted
                decoded_bad.update(bad["reason"] for bad in batch["bad_records"])
        ledger.bad.update(decoded_bad)
        assert ledger.records_read == len(records)
        assert ledger.reconciles, ledger.to_dict()
        faults = Counter(FakeEncoder._fields(r)[2] for r in records)
        assert ledger.bad["unreadable_image"] == faults["measure"]
        assert ledger.bad["corrupt_image"] <= faults["decode"]  # a dropped record is never decoded


def test_a_record_that_cannot_be_measured_is_left_out_of_the_plan_and_reported():
    records = [fake_record(0, 10), fake_record(1, 10, 1, "measure"), fake_record(2, 12)]
    ds = dataset(records)
    planned = sorted(i for pack in ds.plan(0).packs for i in pack)
    assert planned == [0, 2]
    bad = ds.bad_records.records["fake.jsonl:2"]
    assert (bad.reason, bad.stage, bad.record_id) == ("unreadable_image", "measure", "r1")


def test_a_decoding_fault_takes_the_sample_out_of_its_pack_which_is_still_served():
    records = [fake_record(0, 10, 1, "decode")]
    ds = dataset(records, strategy="bfd")
    [item] = [ds[k] for k in range(len(ds))]
    assert item["source_sample_num"] == 0 and len(item["input_ids"]) == 0, "an empty pack: an all-padding row"
    assert [(b["origin"], b["reason"], b["stage"]) for b in item["bad_records"]] == \
        [("fake.jsonl:1", "corrupt_image", "decode")]


def test_under_error_the_first_bad_record_raises_naming_it():
    with pytest.raises(MLLMRecordError, match="fake.jsonl:2: cannot read image header"):
        dataset([fake_record(0, 10), fake_record(1, 10, 1, "measure")], policy="error").plan(0)


def test_too_many_bad_records_stop_with_one_line_naming_the_fraction_and_the_report():
    report = BadRecordReport("skip", max_fraction=0.25)
    ds = dataset([fake_record(i, 10, 1, "measure" if i % 2 else None) for i in range(8)], report=report)
    ds.plan(0)
    assert report.count == 4 and report.records_read == 8
    with pytest.raises(TooManyBadRecords) as err:
        report.check("run/bad_records.jsonl")
    message = str(err.value)
    assert "4 of 8 records are bad (50.0% > data.max_bad_fraction=0.25)" in message
    assert "run/bad_records.jsonl" in message and "\n" not in message


def test_a_truncation_that_leaves_no_supervised_token_is_a_counted_drop():
    class LateAnswer(FakeEncoder):
        """The first supervised token sits at index 30, past the truncation point of record 1."""

        def measure(self, record):
            meta = super().measure(record)
            return type(meta)(meta.length, meta.num_media, meta.media_end, first_supervised=30)

    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=20, strategy="bfd", overlong="truncate"),
                        max_seq_len=20, overlong="truncate")
    ds = MLLMDataKit.build_dataset(spec, LateAnswer(), records=[fake_record(0, 40), fake_record(1, 45)])
    plan = ds.plan(0)
    assert len(plan.packs) == 0 and plan.dropped == {0: "no_supervised_tokens", 1: "no_supervised_tokens"}
    assert ds.epoch_ledger(1, 0).dropped == Counter(no_supervised_tokens=2)


def test_truncated_samples_are_counted():
    ds = dataset([fake_record(0, 90), fake_record(1, 10)], strategy="bfd", max_seq_len=64)
    ledger = ds.epoch_ledger(1, 0)
    assert ledger.truncated == 1 and sum(ledger.dropped.values()) == 0
