"""tools/bench_data.py: what it computes, on tiny inputs.

Checked: the synthetic sets are seeded prefixes of each other with the promised kinds of records; a phase (run
here, in process) times its start as the sum of its parts, a cold start writes its measure cache and a warm start on
it reads it without writing, every phase of a set plans the same packs and the step estimate equals the packs
iterated; the targets, the checks and the extrapolation follow from the phases' numbers, OK/MISS decided by the
limits, a failed phase a MISS naming it. One phase runs as the command, in a fresh process, and exits 0.
Wall-clock values and memory sizes are never asserted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tools import bench_data as bench

SMALL, LARGE = 60, 200


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("bench_data_sets")
    images = bench.write_images(folder / "images", seed=0)
    return {size: bench.write_set(folder, size, images, seed=0) for size in (SMALL, LARGE)}


def test_sets_are_seeded_prefixes_with_the_promised_records(sets):
    small, large = (sets[n].read_text().splitlines() for n in (SMALL, LARGE))
    assert len(small) == SMALL and len(large) == LARGE and large[:SMALL] == small
    records = [json.loads(line) for line in large]
    with_image = [r for r in records if "image" in r]
    assert 0.7 * LARGE < len(with_image) < LARGE  # 85 % of the mix names an image
    assert any(len(r["conversations"]) > 2 for r in records)  # multi-turn chats
    assert len({Path(r["image"]).name.split("-")[1] for r in with_image}) > 10  # images of varied sizes
    assert all((sets[LARGE].parent / r["image"]).is_file() and r["conversations"][0]["value"].startswith("<image>")
               for r in with_image)
    assert bench.write_set(sets[LARGE].parent, LARGE, [], seed=0) == sets[LARGE]  # written once, then reused


def run_phase_here(kind: str, source: Path, cache: Path, tmp_path: Path, name: str) -> dict:
    """``phase_main`` in this process: the numbers a phase process reports."""
    spec = {"kind": kind, "size": LARGE, "workers": 1, "source": str(source), "cache": str(cache),
            "max_seq_len": 1024, "items": 4, "repeats": 1, "result": str(tmp_path / f"{name}.result.json")}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    bench.phase_main(str(path))
    return json.loads(Path(spec["result"]).read_text())


@pytest.fixture(scope="module")
def starts(sets, tmp_path_factory) -> dict[str, dict]:
    """A cold start, a warm start and a per-item phase on one cache folder."""
    tmp = tmp_path_factory.mktemp("bench_data_phases")
    cache = tmp / "cache"
    return {kind: run_phase_here(kind, sets[LARGE], cache, tmp, kind) for kind in ("cold", "warm", "items")}


def test_a_start_is_timed_in_parts_and_plans_what_it_estimates(starts):
    for phase in starts.values():
        assert phase["start_s"] == pytest.approx(phase["store_s"] + phase["measure_s"] + phase["plan_s"])
        assert phase["bad_records"] == 0 and phase["cpu_s"] > 0
        assert phase["steps"] == phase["packs"] == starts["cold"]["packs"] > 1  # one rank, micro-batch 1, one epoch


def test_a_cold_start_writes_the_measure_cache_and_a_warm_start_reads_it(starts):
    cold, warm, items = starts["cold"], starts["warm"], starts["items"]
    assert not cold["cache_hit"]
    assert any(n.startswith("records/") and n.endswith(".arrow") for n in cold["cache_written"])
    assert any(n.startswith("measure/") and n.endswith("done.json") for n in cold["cache_written"])
    for later in (warm, items):
        assert later["cache_hit"] and later["cache_written"] == []


def test_the_per_item_phase_iterates_what_the_step_estimate_says(starts):
    items = starts["items"]
    greedy, bfd = items["greedy"], items["bfd"]
    assert items["dataset"] == "MLLMStreamingPackedDataset" and bfd["dataset"] == "MLLMPackedDataset"
    assert greedy["iterated_packs"] == items["steps"] and bfd["iterated_packs"] == bfd["steps"] == bfd["packs"]
    for entry in (greedy, bfd):
        assert 0 < entry["items"] <= 4 and entry["records_per_item"] >= 1 and entry["per_item_s"] > 0
    assert greedy["items"] == min(4, items["packs"] - 1)  # the epoch's first pack is its start, not an item


def test_phases_are_planned_as_documented():
    phases = bench.plan_phases([100, 1000], 200)
    assert [p.name for p in phases] == ["cold-1w-200", "cold-2w-200", "warm-200", "cold-2w-100", "warm-100",
                                        "cold-2w-1000", "warm-1000", "items-100", "items-1000"]
    caches = {p.name: p.cache for p in phases}
    assert caches["warm-200"] == caches["cold-2w-200"] != caches["cold-1w-200"]
    assert caches["items-100"] == caches["cold-2w-100"] and caches["items-1000"] == caches["warm-1000"]
    assert [p.name for p in bench.plan_phases([200], 200)] == ["cold-1w-200", "cold-2w-200", "warm-200", "items-200"]
    assert bench.parse_args(["--skip-1m"]).sizes == [100_000, 200_000]
    assert bench.parse_args([]).sizes == [100_000, 1_000_000]


# --- the report, from phases with chosen numbers ------------------------------------------------------------------

S, L = 100, 1000  # the smallest and the largest size; phase 1 runs at L


def phase(kind: str, size: int, workers: int = 2, **numbers) -> dict:
    name = f"{kind}-{workers}w-{size}" if kind == "cold" else f"{kind}-{size}"
    base = {"name": name, "kind": kind, "size": size, "workers": workers, "cache_hit": kind != "cold", "packs": 7,
            "steps": 7, "store_s": 0.0, "measure_s": 1.0, "plan_s": 0.0, "start_s": 1.0, "cpu_s": 1.0,
            "load_avg": 1.0, "peak_rss_bytes": bench.GIB, "anon_growth_bytes": 10 * bench.MIB}
    return {**base, **numbers}


def items(size: int, per_item_s: float) -> dict:
    entry = {"per_item_s": per_item_s, "iterated_packs": 7, "items": 5, "repeats": 1, "records_per_item": 2.0,
             "epoch_start_s": 0.0, "replay_s": 0.0}
    return phase("items", size, greedy=dict(entry), bfd={**entry, "steps": 7, "packs": 7, "plan_s": 0.0})


def good_phases() -> list[dict]:
    """Every target met: warm 25x faster, measuring 2x faster on 2 processes, 100 bytes/record, flat items."""
    return [phase("cold", L, 1, start_s=40.0, measure_s=30.0), phase("cold", L, 2, start_s=25.0, measure_s=15.0),
            phase("warm", L, start_s=1.0, anon_growth_bytes=90_000), phase("cold", S, start_s=3.0),
            phase("warm", S, start_s=0.5, anon_growth_bytes=0), items(S, 1e-4), items(L, 1.4e-4)]


def report(phases: list[dict]) -> dict:
    args = bench.parse_args(["--sizes", str(S), str(L), "--parallel-size", str(L), "--workdir", "/nowhere"])
    return bench.report(args, {}, phases, 0.0)


def test_targets_follow_from_the_phases():
    result = report(good_phases())
    targets = {t["name"]: t for t in result["targets"]}
    assert targets["warm_speedup"]["value"] == 25.0 and targets["warm_speedup"]["cold_workers"] == 2
    assert targets["parallel_speedup"]["value"] == 2.0
    assert targets["warm_start"]["value"] == 1.0 and targets["peak_rss"]["value"] == 1.0
    assert targets["anon_per_record"]["value"] == pytest.approx(100.0)
    assert targets["item_ratio"]["ratios"] == pytest.approx({"greedy": 1.4, "bfd": 1.4})
    assert all(t["ok"] for t in result["targets"] + result["checks"]) and result["ok"]


def breaks(name: str, phases: list[dict]) -> None:
    """Set the numbers that make target ``name`` (and only it) a MISS."""
    by = {p["name"]: p for p in phases}
    if name == "warm_speedup":
        by[f"warm-{L}"]["start_s"] = 1.3  # 25 / 1.3 = 19.2x < 20x
    elif name == "parallel_speedup":
        by[f"cold-2w-{L}"]["measure_s"] = 21.0  # 30 / 21 = 1.43x < 1.5x
    elif name == "warm_start":
        by[f"warm-{L}"].update(start_s=60.0)
        for cold in (by[f"cold-1w-{L}"], by[f"cold-2w-{L}"]):
            cold["start_s"] *= 60
    elif name == "peak_rss":
        by[f"warm-{L}"]["peak_rss_bytes"] = 2 * bench.GIB  # not < 2 GiB
    elif name == "anon_per_record":
        by[f"warm-{L}"]["anon_growth_bytes"] = 300 * (L - S)  # not < 300 bytes/record
    elif name == "item_ratio":
        by[f"items-{L}"]["bfd"]["per_item_s"] = 1.6e-4  # 1.6x > 1.5x


@pytest.mark.parametrize("name", ["warm_speedup", "parallel_speedup", "warm_start", "peak_rss", "anon_per_record",
                                  "item_ratio"])
def test_each_target_is_decided_by_its_limit(name):
    phases = copy.deepcopy(good_phases())
    breaks(name, phases)
    verdicts = {t["name"]: t["ok"] for t in report(phases)["targets"]}
    assert [n for n, ok in verdicts.items() if not ok] == [name]


def test_checks_catch_a_missed_cache_a_wrong_estimate_and_different_plans():
    phases = good_phases()
    phases[2]["cache_hit"] = False  # the warm start measured again
    phases[5]["greedy"]["iterated_packs"] = 8  # the estimate said 7
    phases[4]["packs"] = 6  # another plan of the small set
    checks = {c["name"]: c for c in report(phases)["checks"]}
    assert not any(c["ok"] for c in checks.values())
    assert f"missed: warm-{L}" in checks["cache_hits"]["line"]
    assert f"greedy {S}: 7 != 8" in checks["steps_equal_iterated"]["line"]


def test_a_failed_phase_is_a_miss_naming_it():
    phases = [{**p, "error": "exit code 1: boom"} for p in good_phases()]
    result = report(phases)
    assert not result["ok"] and not any(t["ok"] for t in result["targets"] + result["checks"])
    assert all("failed: exit code 1: boom" in t["line"] for t in result["targets"])
    assert all(entry is None for entry in result["extrapolation"].values())


def test_the_extrapolation_is_linear_through_the_two_sizes():
    extra = report(good_phases())["extrapolation"]
    slope = (1.0 - 0.5) / (L - S)
    assert extra["warm_start_s"]["slope_per_record"] == pytest.approx(slope)
    assert extra["warm_start_s"]["value"] == pytest.approx(1.0 + slope * (bench.EXTRAPOLATE_TO - L))
    assert extra["cold_start_s"]["slope_per_record"] == pytest.approx((25.0 - 3.0) / (L - S))


@pytest.mark.launch
def test_a_phase_runs_as_the_command_in_a_fresh_process(sets, tmp_path, monkeypatch):
    """``run_phase`` starts ``python tools/bench_data.py --phase SPEC`` (installed package, no path edits, the
    caller's working directory): it exits 0 and its numbers come back with the phase's own fields."""
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args(["--sizes", str(SMALL), "--parallel-size", str(SMALL), "--items", "3", "--repeats", "1",
                             "--max-seq-len", "1024"])
    cold = bench.plan_phases(args.sizes, args.parallel_size)[0]
    result = bench.run_phase(cold, sets[SMALL], Path("work"), args)  # a relative folder: the child shares our cwd
    assert "error" not in result, result["error"]
    assert (result["name"], result["kind"], result["workers"]) == ("cold-1w-60", "cold", 1)
    assert not result["cache_hit"] and result["steps"] == result["packs"] > 1
    assert Path(result["cache_dir"]) == Path("work/caches") / cold.cache and Path(result["log"]).is_file()
