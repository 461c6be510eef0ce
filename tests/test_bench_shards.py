"""tools/bench_shards.py: the shards it writes and the once-only check it reports, on tiny inputs.

Checked: the written shards are WebDataset shards the DataKit reads back as the mix's records (image records with
their image as a member of their key, placed by extension), written once and reused; the check of a cold start
fails when a record was measured twice or a shard split between ranks; shards past the distinct ones are links to
them. Timings are never asserted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mvp_engine.kit.mllm.data import MLLMDataSpec
from mvp_engine.kit.mllm.data.dataset import MLLMDataKit
from mvp_engine.kit.mllm.data.shards import shard_files
from tools import bench_shards


def test_written_shards_hold_the_mix_with_images_as_members(tmp_path):
    pattern = bench_shards.write_shards(tmp_path, records=30, shards=3, seed=0)
    kind, files = shard_files(pattern)
    assert kind == "webdataset" and len(files) == 3
    store = MLLMDataKit.open_store(MLLMDataSpec(sources=[pattern], cache_dir=str(tmp_path / "cache")))
    records = [store[i] for i in range(len(store))]
    assert [r.record_id for r in records] == [f"syn-{i}" for i in range(30)]
    with_image = [r for r in records if r.image_paths]
    assert 0 < len(with_image) < 30 and all(len(r.image_paths) == 1 for r in with_image)
    assert all(r.image_paths[0].startswith(f"{files[int(r.record_id[4:]) // 10]}#") for r in with_image)  # a member
    assert bench_shards.write_shards(tmp_path, records=30, shards=3, seed=0) == pattern  # reused


def test_shards_past_the_distinct_ones_are_links_to_them_with_their_own_path(tmp_path):
    pattern = bench_shards.write_shards(tmp_path, records=12, shards=4, seed=0, distinct=2)
    files = shard_files(pattern)[1]
    assert [Path(f).read_bytes() for f in files[2:]] == [Path(f).read_bytes() for f in files[:2]]
    assert os.path.samefile(files[3], files[1]) and not os.path.samefile(files[2], files[1])
    assert bench_shards.shard_pattern(Path(files[0]).parent, 4, 2).endswith("shard-{0..1}.tar")
    with pytest.raises(SystemExit, match="no multiple of --shards"):  # linked shards must hold as many records
        bench_shards.write_shards(tmp_path, records=13, shards=4, seed=0, distinct=2)


def result(rank: int, shards: list[str], measured: int, distinct: int) -> dict:
    return {"rank": rank, "shards_measured": shards, "measured": measured, "measured_distinct": distinct}


def test_the_once_check_fails_on_a_record_measured_twice_or_a_shard_split():
    assert bench_shards.check_once([result(0, ["a", "c"], 20, 20), result(1, ["b"], 10, 10)], 30, 3)["ok"]
    assert not bench_shards.check_once([result(0, ["a", "c"], 21, 20), result(1, ["b"], 10, 10)], 30, 3)["ok"]
    assert not bench_shards.check_once([result(0, ["a", "b"], 20, 20), result(1, ["b", "c"], 10, 10)], 30, 3)["ok"]
