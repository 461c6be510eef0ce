"""The record store and the measure cache: every source kind, cache hits, invalidation, and lazy greedy plans that
serve exactly the steps they estimate."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from PIL import Image
from torch.utils.data import DataLoader

from mvp_engine.kit.mllm.data import MLLMDataKit, MLLMDataSpec, MLLMPackingSpec
from mvp_engine.kit.mllm.data.collator import MLLMCollator
from mvp_engine.kit.mllm.data.dataset import PackArrays, ReplayedPacks
from mvp_engine.kit.mllm.data.store import EDGE_BYTES, RecordStore, source_identity
from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder
from recipes.qwen2_vl.model import build_processor
from tests.fakes import FakeEncoder

TINY = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "model" / "qwen2_vl_tiny.yaml").read_text())


class CountingEncoder(Qwen2VLSampleEncoder):
    """Counts ``measure`` calls in this process (one measuring process: small sets never start workers)."""

    calls = 0

    def measure(self, record):
        CountingEncoder.calls += 1
        return super().measure(record)


def encoder(**overrides) -> CountingEncoder:
    return CountingEncoder(build_processor({**TINY, **overrides}))


def records(directory: Path, count: int = 40) -> list[dict]:
    """LLaVA records: images of two sizes, text-only ones, ids; a faulty line is added by the tests that want one."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, size in (("wide.png", (150, 60)), ("tall.png", (120, 320))):
        Image.new("RGB", size, (200, 30, 30)).save(directory / name)
    out = []
    for i in range(count):
        answer = " ".join(f"w{(i * 7 + j) % 19}" for j in range(2 + i % 9))
        if i % 3 == 2:
            out.append({"id": f"t{i}", "conversations": [{"from": "human", "value": f"Say {i}."},
                                                        {"from": "gpt", "value": answer}]})
        else:
            image = f"{directory.name}/{'wide.png' if i % 2 else 'tall.png'}"  # relative to the data file
            out.append({"id": f"i{i}", "image": image, "conversations": [
                {"from": "human", "value": f"<image>\nWhat is {i}?"}, {"from": "gpt", "value": answer}]})
    return out


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


def spec(sources, cache: Path, **packing) -> MLLMDataSpec:
    return MLLMDataSpec(sources=[str(s) for s in sources], cache_dir=str(cache), max_seq_len=256,
                        packing=MLLMPackingSpec(max_seq_len=256, **packing) if packing else None)


def measured(data: MLLMDataSpec, enc=None):
    """A dataset with its metadata measured (or read from the cache), and how many records were measured."""
    enc = enc or encoder()
    before = CountingEncoder.calls
    dataset = MLLMDataKit.build_dataset(data, enc)
    dataset.metas  # noqa: B018 - measuring is lazy
    return dataset, CountingEncoder.calls - before


def test_jsonl_rows_keep_their_origin_and_bad_lines_are_counted_bad_records(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img", 6), ("", "{not json", '{"id": "x"}'))
    dataset, _ = measured(spec([path], tmp_path / "cache", strategy="greedy"))
    store = dataset.records
    assert isinstance(store, RecordStore) and len(store) == 8  # the blank line is no record
    assert [store.origin(i) for i in (0, 5, 6, 7)] == [f"{path}:1", f"{path}:6", f"{path}:8", f"{path}:9"]
    assert store[3].record_id == "i3" and store[3].image_paths == [str(tmp_path / "img" / "wide.png")]
    bad = dataset.bad_records
    assert bad.records_read == 8
    assert {b.origin: (b.reason, b.stage) for b in bad.records.values()} == {
        f"{path}:8": ("invalid_json", "read"), f"{path}:9": ("invalid_record", "read")}
    assert dataset.metas.usable.tolist() == [True] * 6 + [False] * 2


def test_a_second_start_reads_the_cache_and_plans_the_same(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img"))
    first, measured_first = measured(spec([path], tmp_path / "cache", strategy="bfd"))
    second, measured_second = measured(spec([path], tmp_path / "cache", strategy="bfd"))
    assert (measured_first, measured_second) == (40, 0)
    for column in ("length", "num_media", "media_end", "first_supervised", "usable"):
        assert np.array_equal(getattr(first.metas, column), getattr(second.metas, column))
    assert list(first.plan(0).packs) == list(second.plan(0).packs)
    assert first.metas[0] == first.encoder.measure(first.records[0])


def test_the_cache_is_measured_again_when_the_processor_the_data_or_an_image_changes(tmp_path):
    rows = records(tmp_path / "img")
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    cache = tmp_path / "cache"
    base, _ = measured(spec([path], cache))
    smaller, count = measured(spec([path], cache), encoder(image_max_pixels=6272))
    assert count == 40 and smaller.metas.length.sum() < base.metas.length.sum()  # fewer tokens per image
    _, count = measured(spec([path], cache))
    assert count == 0  # the first processor's entry is still there

    Image.new("RGB", (300, 120)).save(tmp_path / "img" / "wide.png")
    grown, count = measured(spec([path], cache))
    assert count == 40 and grown.metas.length.sum() > base.metas.length.sum()

    write_jsonl(path, rows[:-1])
    shorter, count = measured(spec([path], cache))
    assert count == 39 and len(shorter.records) == 39


def test_a_missing_image_that_appears_later_invalidates_the_verdict(tmp_path):
    rows = records(tmp_path / "img", 6)
    rows[0]["image"] = "img/later.png"
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    before, _ = measured(spec([path], tmp_path / "cache"))
    assert [b.reason for b in before.bad_records.records.values()] == ["missing_image"]
    Image.new("RGB", (64, 64)).save(tmp_path / "img" / "later.png")
    after, count = measured(spec([path], tmp_path / "cache"))
    assert count == 6 and after.bad_records.count == 0 and after.metas.usable.all()


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "json"])
def test_parquet_saved_and_json_sources_measure_and_plan_like_the_jsonl(tmp_path, kind):
    rows = records(tmp_path / "img")
    jsonl = write_jsonl(tmp_path / "data.jsonl", rows)
    for row in rows:
        row.setdefault("image", None)  # one schema for every row, as a parquet or Arrow table has
    if kind == "parquet":
        source = tmp_path / "data.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(source))
    elif kind == "save_to_disk":
        source = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(source))
    else:
        source = tmp_path / "data.json"
        source.write_text(json.dumps(rows, indent=1))
    reference, _ = measured(spec([jsonl], tmp_path / "cache", strategy="greedy"))
    other, count = measured(spec([source], tmp_path / "cache", strategy="greedy"))
    assert count == 40 and len(other.records) == 40
    assert np.array_equal(other.metas.length, reference.metas.length)
    assert list(other.plan(0).packs) == list(reference.plan(0).packs)
    assert other.records[5].messages == reference.records[5].messages
    if kind != "json":
        assert other.records.origin(5) == f"{source}#6"


def test_several_sources_concatenate_in_order(tmp_path):
    rows = records(tmp_path / "img")
    first = write_jsonl(tmp_path / "a.jsonl", rows[:15])
    second = tmp_path / "b.parquet"
    datasets.Dataset.from_list([{**r, "image": r.get("image")} for r in rows[15:]]).to_parquet(str(second))
    both, _ = measured(spec([first, second], tmp_path / "cache"))
    whole, _ = measured(spec([write_jsonl(tmp_path / "all.jsonl", rows)], tmp_path / "cache"))
    assert np.array_equal(both.metas.length, whole.metas.length)
    assert [both.records[i].record_id for i in (0, 14, 15, 39)] == ["i0", "t14", "i15", "i39"]
    assert both.records.origin(15) == f"{second}#1"


def test_the_lazy_greedy_plan_is_replayed_not_stored_and_serves_its_estimate(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img", 90))
    data = spec([path], tmp_path / "cache", strategy="greedy", buffer_size=16, max_open_packs=4)
    micro_batch, served = 2, 0
    for rank in range(2):
        dataset = MLLMDataKit.build_dataset(data, encoder(), rank=rank, world_size=2)
        plan = dataset.plan(0)
        assert isinstance(plan.packs, ReplayedPacks)
        assert list(plan.packs) == list(plan.packs) and len(list(plan.packs)) == len(plan.packs) > 4
        loader = DataLoader(dataset, batch_size=micro_batch, collate_fn=MLLMCollator(pad_token_id=0))
        batches = list(loader)
        assert len(batches) == dataset.estimate_total_steps(1, micro_batch)
        served += sum(int(sum(batch["source_sample_num"])) for batch in batches)
    planned = sum(len(pack) for pack in plan.packs)
    assert served == planned == int(dataset.admission.admitted_mask.sum())


def test_a_whole_set_bfd_plan_is_stored_as_offsets_with_constant_time_rank_slices(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img", 50))
    data = spec([path], tmp_path / "cache", strategy="bfd", buffer_size=10_000)
    datasets_by_rank = [MLLMDataKit.build_dataset(data, encoder(), rank=r, world_size=3) for r in range(3)]
    plan = datasets_by_rank[0].plan(0)
    assert isinstance(plan.packs, PackArrays)
    packs = list(plan.packs)
    for rank, dataset in enumerate(datasets_by_rank):
        mine = dataset.rank_packs(0)
        assert [mine[j] for j in range(len(mine))] == list(mine)
        assert [p for p in mine if p] == packs[rank::3]


def _measure_in_child(data: MLLMDataSpec, out: str) -> None:
    _, count = measured(data)
    Path(out).write_text(str(count))


def test_two_processes_starting_together_measure_once(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img", 60))
    data = spec([path], tmp_path / "cache")
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_measure_in_child, args=(data, str(tmp_path / f"count{k}"))) for k in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=240)
        assert child.exitcode == 0
    counts = sorted(int((tmp_path / f"count{k}").read_text()) for k in range(2))
    assert counts == [0, 60]
    assert not any(name.endswith(".partial") for name in os.listdir(tmp_path / "cache" / "records"))


def test_measuring_in_two_processes_gives_what_one_gives(tmp_path, monkeypatch):
    monkeypatch.setattr("mvp_engine.kit.mllm.data.measure.ROWS_PER_WORKER", 10)
    path = write_jsonl(tmp_path / "data.jsonl", records(tmp_path / "img", 60), ("{bad",))
    results = []
    for workers in (1, 2):
        data = spec([path], tmp_path / f"cache{workers}")
        data.measure_workers = workers
        dataset, _ = measured(data)
        files = json.loads(next((tmp_path / f"cache{workers}" / "measure").glob("*/done.json")).read_text())["files"]
        assert len(files) == workers
        results.append(dataset)
    one, two = results
    for column in ("length", "num_media", "media_end", "first_supervised", "usable"):
        assert np.array_equal(getattr(one.metas, column), getattr(two.metas, column))
    assert list(one.bad_records.records.values()) == list(two.bad_records.records.values())
    assert two.bad_records.count == 1


def test_bad_records_after_a_first_batch_of_good_ones_and_an_empty_source(tmp_path):
    rows = records(tmp_path / "img", 300)  # more than one map batch before the bad line
    path = write_jsonl(tmp_path / "data.jsonl", rows, ("{bad",))
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    dataset, count = measured(spec([path, empty], tmp_path / "cache", strategy="greedy"))
    assert count == 300 and len(dataset.records) == 301
    assert [(b.origin, b.reason) for b in dataset.bad_records.records.values()] == [(f"{path}:301", "invalid_json")]
    assert len(dataset.plan(0).packs) > 0


class CachedFake(FakeEncoder):
    """The synthetic encoder with a fingerprint (so its lengths are cached), counting its measures."""

    calls = 0

    def fingerprint(self) -> str:
        return "fake"

    def measure(self, record):
        CachedFake.calls += 1
        return super().measure(record)


def fake_lines(path: Path, lengths: list[int]) -> Path:
    """FakeEncoder records (each states its length) as JSONL."""
    return write_jsonl(path, [{"id": f"r{i}", "messages": [{"role": "user", "content": f"{n} 0"},
                                                           {"role": "assistant", "content": "ok"}]}
                              for i, n in enumerate(lengths)])


def fake_lengths(data: MLLMDataSpec) -> tuple[list[int], int]:
    before = CachedFake.calls
    dataset = MLLMDataKit.build_dataset(data, CachedFake())
    return dataset.metas.length.tolist(), CachedFake.calls - before


def test_a_source_rewritten_at_its_size_with_its_mtime_kept_is_measured_again(tmp_path):
    """``cp -p``, ``rsync -a`` and tar keep a rewritten file's mtime: the same size and mtime must not keep the old
    lengths (nor the old converted rows)."""
    path = fake_lines(tmp_path / "data.jsonl", [10, 20, 30])
    data = MLLMDataSpec(sources=[str(path)], cache_dir=str(tmp_path / "cache"), measure_workers=1)
    assert fake_lengths(data) == ([10, 20, 30], 3)
    assert fake_lengths(data) == ([10, 20, 30], 0)  # unchanged: read from the cache
    before = os.stat(path)
    fake_lines(path, [40, 50, 60])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert fake_lengths(data) == ([40, 50, 60], 3)


def test_a_change_past_the_hashed_ends_with_size_and_mtime_kept_changes_the_identity(tmp_path):
    """The middle of a large file is not hashed; its rewrite still moves the ctime, which nothing can set back."""
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"a" * 3 * EDGE_BYTES)
    before, identity = os.stat(path), source_identity(path)
    time.sleep(0.05)  # past the file system's timestamp tick
    with path.open("r+b") as handle:
        handle.seek(EDGE_BYTES + 7)
        handle.write(b"b")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source_identity(path) != identity


def test_a_record_over_max_record_bytes_is_a_counted_bad_record_and_the_others_train(tmp_path):
    path = fake_lines(tmp_path / "data.jsonl", [10, 20])
    long = {"id": "long", "messages": [{"role": "user", "content": "30 0 " + "x" * 500},
                                       {"role": "assistant", "content": "ok"}]}
    with path.open("a") as handle:
        handle.write(json.dumps(long) + "\n")
    data = MLLMDataSpec(sources=[str(path)], cache_dir=str(tmp_path / "cache"), measure_workers=1,
                        max_record_bytes=200)
    dataset = MLLMDataKit.build_dataset(data, CachedFake())
    assert dataset.metas.usable.tolist() == [True, True, False]
    (bad,) = dataset.bad_records.records.values()
    assert (bad.origin, bad.reason, bad.stage) == (f"{path}:3", "record_too_large", "read")
    assert "over data.max_record_bytes=200" in bad.message
    roomy = MLLMDataSpec(sources=[str(path)], cache_dir=str(tmp_path / "cache"), measure_workers=1)
    assert fake_lengths(roomy)[0] == [10, 20, 30]  # another limit: converted and measured afresh
    with pytest.raises(ValueError, match=r"^data.max_record_bytes=0 is invalid: allowed an int >= 1"):
        MLLMDataSpec(max_record_bytes=0)


def test_an_image_outside_the_image_root_is_a_counted_bad_record_of_the_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "secret.png")
    path = fake_lines(data / "data.jsonl", [10])
    escape = {"id": "up", "image": "../secret.png", "messages": [{"role": "user", "content": "20 1"},
                                                                  {"role": "assistant", "content": "ok"}]}
    with path.open("a") as handle:
        handle.write(json.dumps(escape) + "\n")
    spec = MLLMDataSpec(sources=[str(path)], cache_dir=str(tmp_path / "cache"), measure_workers=1)
    dataset = MLLMDataKit.build_dataset(spec, CachedFake())
    assert dataset.metas.usable.tolist() == [True, False]
    assert [(b.origin, b.record_id, b.reason) for b in dataset.bad_records.records.values()] == [
        (f"{path}:2", "up", "image_outside_root")]


def test_data_media_roots_admit_a_linked_media_folder_and_a_change_of_them_measures_again(tmp_path):
    """A verdict of ``image_outside_root`` is cached with the lengths: a run that adds the folder to
    ``data.media_roots`` must read the record again, not train without it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    Image.new("RGB", (8, 8)).save(shared / "a.png")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "coco").symlink_to(shared, target_is_directory=True)
    path = fake_lines(tmp_path / "data" / "data.jsonl", [10])
    linked = {"id": "linked", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "20 1"}, {"type": "image", "path": "coco/a.png"}]},
        {"role": "assistant", "content": "ok"}]}
    with path.open("a") as handle:
        handle.write(json.dumps(linked) + "\n")
    common = {"sources": [str(path)], "cache_dir": str(tmp_path / "cache"), "measure_workers": 1}
    refused = MLLMDataKit.build_dataset(MLLMDataSpec(**common), CachedFake())
    assert refused.metas.usable.tolist() == [True, False]
    (bad,) = refused.bad_records.records.values()
    assert bad.reason == "image_outside_root" and "add its folder to data.media_roots" in bad.message
    admitted = MLLMDataSpec(**common, media_roots=[str(shared)])
    assert fake_lengths(admitted) == ([10, 20], 2)  # measured again under the new roots
    assert fake_lengths(admitted) == ([10, 20], 0)  # and cached under them
    with pytest.raises(ValueError, match=r"^data.media_roots=\[''\] is invalid: allowed a list of folders"):
        MLLMDataSpec(media_roots=[""])
