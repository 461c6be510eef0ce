"""Shard sources train what the same records train as one JSONL file, and name a bad member by its origin.

The same eight records (images and text only) written as WebDataset tar shards (a brace pattern over two shards,
images as members: half named by the record, half by extension only), as an Energon-prepared folder of such shards
and as a folder of parquet files train the same packs, steps (estimated == actual) and losses as the JSONL; a folder
of Arrow files reads the JSONL's records, each named by its file and row; a resume over a shard pattern (named by its
folder) is refused once a shard is added; a shard pattern is a mixture entry like any source (named by its folder,
drawn ``repeat`` times).
``tools/check_data.py`` reads a tar shard holding every kind of bad member and names each by ``shard.tar#key``. Two
pooled ranks measure a set of shards together: each shard once (the encoder's calls counted on both ranks), and a
second start measures none; a rank's worker processes measure whole shards, each record once. An Energon-prepared
folder (megatron-energon's own ``prepare`` code) trains the JSONL's packs from its ``train`` split part alone (a
held-out shard and an excluded sample beside it), names its bad members as a tar shard does (a shard cut short after
preparing included), and is refused in one line when its index is stale, it is typed by a field map or
megatron-energon is missing.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path

import datasets
import pytest

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.run_identity import check_identity, run_identity
from mvp_engine.engine.testkit.runs import run_on_ranks
from mvp_engine.engine.trainer import Trainer
from mvp_engine.kit.mllm.data import MLLMDataSpec, MLLMPackingSpec, MLLMRecordError, shards, source_kind
from mvp_engine.kit.mllm.data.bad_records import BadRecordReport
from mvp_engine.kit.mllm.data.dataset import MLLMDataKit
from mvp_engine.kit.mllm.data.measure import measure_store
from tests.fakes import FakeEncoder
from tools.check_data import check_records

RECIPE = "llava"
NUM_RECORDS = 8


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """The folder of the rows' images: the JSONL and parquet sources lie elsewhere and name it ``data.image_root``."""
    return tmp_path_factory.mktemp("rows")


@pytest.fixture(scope="module")
def rows(images) -> list[dict]:
    """LLaVA records alternating image and text only; image paths absolute."""
    jsonl = kit.write_mixed_jsonl(images, num_records=NUM_RECORDS)
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, rows: list[dict], shards: int) -> str:
    """``rows`` as WebDataset shards ``shard-{0..shards-1}.tar`` in ``folder``; the brace pattern naming them.
    Image records carry their image as the member ``<key>.png``: every other one names it, the rest leave it to be
    found by extension."""
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(rows) // shards)
    for s in range(shards):
        with tarfile.open(folder / f"shard-{s}.tar", "w") as tar:
            for i, row in enumerate(rows[s * per_shard:(s + 1) * per_shard], start=s * per_shard):
                key, record = f"{i:06d}", dict(row)
                image = record.pop("image", None)
                if image is not None:
                    if i % 4 == 0:
                        record["image"] = f"{key}.png"
                    add_member(tar, f"{key}.png", Path(image).read_bytes())
                add_member(tar, f"{key}.json", json.dumps(record).encode())
    return str(folder / f"shard-{{0..{shards - 1}}}.tar")


def prepare_energon(folder: Path, train: list[str], held_out: list[str], excluded: list[str] = ()) -> str:
    """``folder``'s tar shards prepared by megatron-energon's own ``energon prepare`` code: ``train`` (shard names)
    the ``train`` split part, ``held_out`` the ``val`` part; ``excluded`` (``shard.tar/key``) added to the split's
    excludes, as a user edits ``split.yaml``. A crude ``dataset.yaml``, as ``energon prepare`` writes for one."""
    import yaml
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    parts = [(part, "|".join(f"^{re.escape(name)}$" for name in names))
             for part, names in (("train", train), ("val", held_out)) if names]
    WebdatasetPreparator.prepare_dataset(folder, train + held_out, workers=1, split_parts_patterns=parts)
    split = folder / ".nv-meta" / "split.yaml"
    split.write_text(yaml.safe_dump({**yaml.safe_load(split.read_text()), "exclude": list(excluded)}))
    (folder / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    return str(folder)


def write_energon(folder: Path, rows: list[dict]) -> str:
    """``rows`` in two train shards of an Energon-prepared folder, beside a held-out shard and an excluded sample
    (records the JSONL does not hold: reading them would change the packs)."""
    write_shards(folder, rows, shards=2)
    extra = [{"id": f"held{i}", "conversations": [{"from": "human", "value": "held out"},
                                                   {"from": "gpt", "value": "never trained"}]} for i in range(3)]
    with tarfile.open(folder / "shard-2.tar", "w") as tar:  # the val part's shard
        for i, record in enumerate(extra[:2]):
            add_member(tar, f"val{i:03d}.json", json.dumps(record).encode())
    with tarfile.open(folder / "shard-1.tar", "a") as tar:  # a train shard's sample the split excludes
        add_member(tar, "dropped.json", json.dumps(extra[2]).encode())
    return prepare_energon(folder, ["shard-0.tar", "shard-1.tar"], ["shard-2.tar"], ["shard-1.tar/dropped"])


def write_parquet_folder(folder: Path, rows: list[dict], files: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"image": None, **row} for row in rows]  # one schema in every file
    per_file = -(-len(rows) // files)
    for f in range(files):
        datasets.Dataset.from_list(rows[f * per_file:(f + 1) * per_file]).to_parquet(str(folder / f"part-{f}.parquet"))
    return str(folder)


def train(source: str, out: Path, images: Path) -> dict:
    cfg = kit.compose_config(RECIPE, ["+packing=greedy", f"data.sources=['{source}']", f"data.image_root={images}",
                                      "data.max_seq_len=256",
                                      "train.epochs=1", "train.micro_batch_size=1", f"train.output_dir={out}",
                                      f"data.cache_dir={out / 'cache'}"])
    trainer = Trainer(cfg, kit.load_recipe(RECIPE))
    summary = trainer.run()
    records = trainer.dataset.records
    summary["record_ids"] = [records[i].record_id for i in range(len(records))]
    summary["packs"] = [list(pack) for pack in trainer.dataset.plan(0).packs]
    return summary


@pytest.fixture(scope="module")
def reference(rows, images, tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("reference")
    jsonl = directory / "data.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train(str(jsonl), directory / "run", images)


@pytest.mark.parametrize("kind", ["webdataset", "energon", "parquet_shards"])
def test_a_shard_source_trains_the_packs_and_steps_of_the_same_records_in_jsonl(rows, images, reference, tmp_path,
                                                                               kind):
    if kind == "webdataset":
        source = write_shards(tmp_path / "shards", rows, shards=2)
    elif kind == "energon":
        source = write_energon(tmp_path / "prepared", rows)
    else:
        source = write_parquet_folder(tmp_path / "parquet", rows, files=3)
    assert source_kind(source) == kind
    summary = train(source, tmp_path / "run", images)
    assert summary["record_ids"] == [row["id"] for row in rows] == reference["record_ids"]
    assert summary["packs"] == reference["packs"]
    [ledger] = summary["epochs"]
    assert ledger["samples_trained"] == NUM_RECORDS and ledger["reconciles"] and not ledger["bad"]
    assert summary["estimated_steps"] == summary["actual_steps"] == reference["actual_steps"] > 0
    assert summary["totals"] == reference["totals"] and summary["losses"] == reference["losses"]


def write_bad_members(shard: Path, rows: list[dict]) -> Path:
    """A shard with one of each bad member between good ones: invalid JSON, a key without a record, a medium that
    is no member and no file, an image whose body does not decode; its last member, ``tail``, a good text record
    (the tests cut it short)."""
    image_row, text_row = rows[0], rows[1]
    png = Path(image_row["image"]).read_bytes()
    with tarfile.open(shard, "w") as tar:
        add_member(tar, "good.json", json.dumps({**image_row, "image": "good.png"}).encode())
        add_member(tar, "good.png", png)
        add_member(tar, "broken.json", b'{"conversations": [')
        add_member(tar, "orphan.png", png)
        add_member(tar, "absent.json", json.dumps({**image_row, "id": "absent", "image": "nowhere.png"}).encode())
        add_member(tar, "cut.json", json.dumps({**image_row, "id": "cut", "image": None}).encode())
        add_member(tar, "cut.png", png[:len(png) // 2])
        add_member(tar, "text.json", json.dumps(text_row).encode())
        add_member(tar, "tail.json", json.dumps(text_row).encode())
    return shard


def checked_after_cutting_the_tail(shard: Path, source: Path, tmp_path: Path):
    """``check_data``'s report (decoding too) of ``source`` after ``shard``'s last member is cut short: its header and
    4 bytes of its data kept."""
    data = shard.read_bytes()
    shard.write_bytes(data[:data.index(b"tail.json") + 512 + 4])
    cfg = kit.compose_config(RECIPE, [f"data.sources=[{source}]", f"data.cache_dir={tmp_path / 'cache'}"])
    return check_records(cfg, RECIPE, decode=True, workers=1)


def test_check_data_names_each_bad_member_by_shard_and_key(rows, tmp_path):
    """A shard with one of each bad member: invalid JSON, a key without a record, a medium that is no member and
    no file, an image whose body does not decode, and a last member cut short by the end of the file."""
    shard = write_bad_members(tmp_path / "bad.tar", rows)
    report = checked_after_cutting_the_tail(shard, shard, tmp_path)
    assert {bad.origin: (bad.reason, bad.stage) for bad in report.records.values()} == {
        f"{shard}#broken": ("invalid_json", "read"), f"{shard}#orphan": ("no_record_member", "read"),
        f"{shard}#absent": ("missing_image", "read"), f"{shard}#cut": ("corrupt_image", "decode"),
        f"{shard}#tail": ("truncated_member", "read")}
    assert report.records_read == 7


@pytest.mark.parametrize("form", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_index_reads_plain_headers_as_tarfile_does_and_leaves_tarfile_the_rest(form, tmp_path):
    """A shard's members are read from its headers directly (``shards._plain_members``) where every header is a
    plain one, whole or cut short anywhere, and are then exactly ``tarfile``'s; a long or non-ASCII name (pax / GNU
    headers), a bad checksum or a header cut short is left to ``tarfile``."""
    def shard(name: str, members: list[tuple[str, bytes | None]]) -> bytes:
        with tarfile.open(tmp_path / name, "w", format=form) as tar:
            for member, data in members:
                if data is None:
                    folder = tarfile.TarInfo(member)
                    folder.type = tarfile.DIRTYPE
                    tar.addfile(folder)
                else:
                    add_member(tar, member, data)
        return (tmp_path / name).read_bytes()

    def members(data: bytes) -> tuple[list | None, list]:
        (tmp_path / "read.tar").write_bytes(data)
        return shards._plain_members(str(tmp_path / "read.tar"), len(data)), \
            list(shards._tarfile_members(str(tmp_path / "read.tar")))

    plain = shard("plain.tar", [("a/0.json", b"{}"), ("dir", None), ("0.png", b"x" * 700), ("1.json", b"[]")])
    for cut in (len(plain), 512 * 4, 512 * 4 + 100, 512 * 6 - 5, 512 * 7):  # whole, or cut in a member's data
        fast, slow = members(plain[:cut])
        assert fast == slow and len(fast) == (3 if cut == len(plain) else 2 if cut < 512 * 7 else 3)
    damaged = bytearray(plain)
    damaged[512 * 6 + 10] ^= 0xFF  # the last member's header no longer checks out
    for data in (plain[:512 * 6 + 300], bytes(damaged)):  # that header cut short, or damaged
        fast, slow = members(data)
        assert fast is None and slow == members(plain)[1][:2]
    for name in ("x" * 120 + "/k.json", "ключ.json"):
        fast, slow = members(shard("odd.tar", [("0.json", b"{}"), (name, b"{}")]))
        assert slow[-1][0] == name and fast in (None, slow)


class CountingEncoder(FakeEncoder):
    """FakeEncoder with a fingerprint (so its measures are cached) that counts the records it measures."""

    def __init__(self):
        self.measured: list[str] = []

    def fingerprint(self) -> str:
        return "counting-fake"

    def measure(self, record):
        self.measured.append(record.origin)
        return super().measure(record)


def measure_on_rank(rank: int, source: str, cache: str) -> dict:
    """One rank's measure pass over ``source`` (``measure_workers=1``: the share is the rank's alone), twice."""
    world_size = int(os.environ["WORLD_SIZE"])
    spec = MLLMDataSpec(sources=[source], cache_dir=cache, measure_workers=1)
    store = MLLMDataKit.open_store(spec)
    cold, warm = CountingEncoder(), CountingEncoder()
    metas = measure_store(store, cold, BadRecordReport(), cache, 1, rank=rank, world_size=world_size)
    again = measure_store(store, warm, BadRecordReport(), cache, 1, rank=rank, world_size=world_size)
    return {"cold": cold.measured, "warm": warm.measured, "lengths": metas.length.tolist(),
            "again": again.length.tolist()}


@pytest.mark.launch
def test_two_ranks_measure_each_shard_once_and_a_warm_start_measures_none(tmp_path):
    shards, per_shard = 6, 3
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"{5 + i} 0"},
                                                 {"from": "gpt", "value": "ok"}]} for i in range(shards * per_shard)]
    source = write_shards(tmp_path / "shards", records, shards=shards)
    ranks = run_on_ranks(2, measure_on_rank, source, str(tmp_path / "cache"))
    measured = [origin for rank in ranks for origin in rank["cold"]]
    assert sorted(measured) == sorted(f"{tmp_path / 'shards'}/shard-{i // per_shard}.tar#{i:06d}"
                                      for i in range(len(records)))  # every record once, over both ranks
    for result in ranks:  # a shard is measured whole by one rank (which one: the first to claim it)
        for shard in {origin.split("#")[0] for origin in result["cold"]}:
            assert sum(origin.startswith(f"{shard}#") for origin in result["cold"]) == per_shard
        assert result["warm"] == []
        assert result["lengths"] == result["again"] == [5 + i for i in range(len(records))]


def test_a_folder_of_arrow_files_reads_the_records_of_each_file_by_file_and_row(rows, images, tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"image": None, **row} for row in rows]).save_to_disk(str(saved), num_shards=2)
    folder = tmp_path / "arrow"
    folder.mkdir()
    files = sorted(saved.glob("*.arrow"))
    for file in files:  # the data files alone: a folder of Arrow shards, no longer a saved data set
        (folder / file.name).write_bytes(file.read_bytes())
    assert source_kind(folder) == "arrow_shards"
    spec = MLLMDataSpec(sources=[str(folder)], image_root=str(images), cache_dir=str(tmp_path / "cache"))
    store = MLLMDataKit.open_store(spec)
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reference = MLLMDataKit.open_store(MLLMDataSpec(sources=[str(jsonl)], image_root=str(images),
                                                    cache_dir=str(tmp_path / "cache")))
    assert [store[i].messages for i in range(len(store))] == [reference[i].messages for i in range(len(rows))]
    half = len(rows) // 2
    assert [store.origin(i) for i in (0, half)] == [f"{folder / files[0].name}#1", f"{folder / files[1].name}#1"]


def test_a_resume_over_a_shard_pattern_is_refused_once_a_shard_is_added(rows, tmp_path):
    folder = tmp_path / "shards"
    write_shards(folder, rows[:4], shards=2)

    def identity() -> dict:
        cfg = kit.compose_config(RECIPE, [f"data.sources=['{folder}/*.tar']"])
        return run_identity(RECIPE, resolve_run_specs(cfg, kit.load_recipe(RECIPE).attention_backends))

    before = identity()
    assert check_identity(before, identity(), tmp_path) is None
    write_shards(tmp_path / "more", rows[4:], shards=1)
    (tmp_path / "more" / "shard-0.tar").rename(folder / "shard-2.tar")  # the pattern now matches a third shard
    with pytest.raises(ConfigError, match="data source 'shards' changed"):
        check_identity(before, identity(), tmp_path)


def test_check_data_names_each_bad_member_of_an_energon_source_by_shard_and_key(rows, tmp_path):
    """Energon's index, not a scan of the tar, says where members lie; a bad one is named as a tar shard's is."""
    folder = tmp_path / "prepared"
    folder.mkdir()
    shard = write_bad_members(folder / "bad.tar", rows)
    prepare_energon(folder, ["bad.tar"], [])
    report = checked_after_cutting_the_tail(shard, folder, tmp_path)  # after preparing: the index outlives the bytes
    assert {bad.origin: (bad.reason, bad.stage) for bad in report.records.values()} == {
        f"{shard}#broken": ("invalid_json", "read"), f"{shard}#orphan": ("no_record_member", "read"),
        f"{shard}#absent": ("missing_image", "read"), f"{shard}#cut": ("corrupt_image", "decode"),
        f"{shard}#tail": ("truncated_member", "read")}
    assert report.records_read == 7


def test_an_energon_folder_is_refused_in_one_line_when_energon_cannot_read_it(rows, tmp_path, monkeypatch):
    """An index that counts fewer samples than the info (stale) stops the store; an eval source naming the folder
    (it would evaluate the train part), a typed dataset (a field map over its parts) and a missing megatron-energon
    each stop the config check."""
    source = write_shards(tmp_path / "prepared", rows[:2], shards=1)
    prepare_energon(tmp_path / "prepared", ["shard-0.tar"], [])
    assert source_kind(tmp_path / "prepared") == "energon" and source_kind(source) == "webdataset"
    info = tmp_path / "prepared" / ".nv-meta" / ".info.json"
    info.write_text(json.dumps({"shard_counts": {"shard-0.tar": 3}}))  # one sample more than the index holds
    spec = MLLMDataSpec(sources=[str(tmp_path / "prepared")], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MLLMRecordError, match=r"index holds 2 samples of .*shard-0.tar, its .nv-meta info counts 3: "
                                              "the index is stale"):
        MLLMDataKit.open_store(spec)
    with pytest.raises(ValueError, match=r"data.eval_sources\[0\]: .*prepared is an Energon-prepared folder, read as "
                                         "its 'train' split part: name its held-out shards by pattern instead"):
        MLLMDataSpec(sources=[source], eval_sources=[str(tmp_path / "prepared")])
    config = tmp_path / "prepared" / ".nv-meta" / "dataset.yaml"
    config.write_text("sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
                      "field_map:\n  image: png\n  context: json[question]\n  answers: json[answer]\n")
    with pytest.raises(MLLMRecordError, match=f"{config}: the dataset is typed as VQASample; only crude datasets"):
        source_kind(tmp_path / "prepared")
    monkeypatch.setitem(sys.modules, "megatron.energon.epathlib", None)  # as if megatron-energon were not installed
    with pytest.raises(MLLMRecordError, match=r"megatron-energon's index, which is not installed: pip install "
                                              r"'vlm-packing\[energon\]'"):
        source_kind(tmp_path / "prepared")


class LoggingEncoder(FakeEncoder):
    """FakeEncoder with a fingerprint that appends each record it measures, with its process id, to a file: a count
    across forked worker processes."""

    def __init__(self, log: Path):
        self.log = log

    def fingerprint(self) -> str:
        return "logging-fake"

    def measure(self, record):
        with open(self.log, "a") as handle:
            handle.write(f"{os.getpid()} {record.origin}\n")
        return super().measure(record)


def test_a_rank_s_worker_processes_measure_disjoint_shares_of_the_shards(tmp_path):
    shards, per_shard = 4, 3
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"{3 + i} 0"},
                                                 {"from": "gpt", "value": "ok"}]} for i in range(shards * per_shard)]
    source = write_shards(tmp_path / "shards", records, shards=shards)
    spec = MLLMDataSpec(sources=[source], cache_dir=str(tmp_path / "cache"), measure_workers=2)
    log = tmp_path / "measured.log"
    metas = measure_store(MLLMDataKit.open_store(spec), LoggingEncoder(log), BadRecordReport(), spec.cache_dir, 2)
    measured = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert sorted(origin for _, origin in measured) == sorted(
        f"{tmp_path / 'shards'}/shard-{i // per_shard}.tar#{i:06d}" for i in range(len(records)))  # each once
    assert os.getpid() not in {int(pid) for pid, _ in measured}  # measured in the forked workers
    for shard in {origin.split("#")[0] for _, origin in measured}:  # a shard whole by one worker
        assert len({pid for pid, origin in measured if origin.startswith(f"{shard}#")}) == 1
    assert metas.length.tolist() == [3 + i for i in range(len(records))]


def test_a_shard_source_is_a_mixture_entry_drawn_repeat_times(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"{20 + i} 0"},
                                                 {"from": "gpt", "value": "ok"}]} for i in range(6)]
    source = write_shards(tmp_path / "shards", records[:4], shards=2)
    jsonl = tmp_path / "rest.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records[4:]))
    spec = MLLMDataSpec(sources=[{"path": source, "repeat": 2}, {"path": str(jsonl), "repeat": 0.5}],
                        packing=MLLMPackingSpec(max_seq_len=64), cache_dir=str(tmp_path / "cache"))
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder())
    assert [entry.name for entry in dataset.sources] == ["shards", "rest"]
    assert [t.records for t in dataset.epoch_sources()] == [8, 1]  # every shard record twice, half the JSONL's
    assert dataset.estimate_total_steps(epochs=1) == sum(1 for _ in dataset.rank_packs()) > 0
