"""tools/bench_data.py on tiny sets: every phase ran, the warm starts really read the cache, the plans agree, and the
printed report follows from the JSON.

Wall-clock values and memory sizes are never asserted (they depend on the machine and its load); only what holds
whatever they are: a cold start writes its cache and no later phase rewrites it (file modification times), every
phase of a set plans the same packs, the step estimate equals the packs iterated, the sets are seeded prefixes of
each other with the promised kinds of records, and each printed number and OK/MISS verdict is the one the JSON
values give.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_data.py"
SMALL, LARGE = 200, 1000  # LARGE is also the parallel size: its phase-1 starts are reused as phase 2's
TINY = ["--sizes", str(SMALL), str(LARGE), "--parallel-size", str(LARGE), "--items", "40", "--repeats", "1"]
MIB, GIB = 2**20, 2**30

ROW = re.compile(r"^(?P<name>(?:cold|warm|items)\S*)\s+(?P<size>[\d,]+)\s+(?P<cache>hit|miss)\s+(?P<store>[\d.]+)\s+"
                 r"(?P<measure>[\d.]+)\s+(?P<plan>[\d.]+)\s+(?P<start>[\d.]+)\s+(?P<cpu>[\d.]+)\s+(?P<load>[\d.]+)\s+"
                 r"(?P<packs>[\d,]+)\s+(?P<steps>[\d,]+)\s+"
                 r"(?P<peak>[\d.]+)\s+(?P<anon>-?[\d.]+)$")
TARGET = re.compile(r"^\s+\((?P<number>\d)\) (?P<text>.*) -> (?P<verdict>OK|MISS)$")
CHECK = re.compile(r"^\s+(?P<text>(?:warm and per-item|step estimate|greedy packs planned).*) -> (?P<verdict>OK|MISS)$")


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through its module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return load_tool()


@pytest.fixture(scope="module")
def bench(tool, tmp_path_factory):
    """One tiny run of the tool: its returned dict, its printed lines, its JSON file and its work folder."""
    workdir = tmp_path_factory.mktemp("bench_data")
    path = workdir / "bench.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = tool.main([*TINY, "--workdir", str(workdir), "--json", str(path)])
    return result, out.getvalue().splitlines(), json.loads(path.read_text()), workdir


def phases(bench, kind: str | None = None) -> list[dict]:
    return [p for p in bench[2]["phases"] if kind in (None, p["kind"])]


def one(bench, kind: str, size: int, workers: int | None = None) -> dict:
    found = [p for p in phases(bench, kind) if p["size"] == size and workers in (None, p["workers"])]
    assert len(found) == 1, f"expected one {kind} phase at {size} records"
    return found[0]


def test_every_phase_ran_and_the_json_holds_what_was_returned(bench):
    result, _, saved, _ = bench
    assert json.loads(json.dumps(result, default=str)) == saved
    names = [p["name"] for p in phases(bench)]
    assert names == [f"cold-1w-{LARGE}", f"cold-2w-{LARGE}", f"warm-{LARGE}", f"cold-2w-{SMALL}", f"warm-{SMALL}",
                     f"items-{SMALL}", f"items-{LARGE}"]
    for phase in phases(bench):
        assert "error" not in phase, phase
        assert phase["bad_records"] == 0
        assert phase["start_s"] == pytest.approx(phase["store_s"] + phase["measure_s"] + phase["plan_s"])


def test_cold_starts_write_their_cache_and_nothing_rewrites_it(bench, tool):
    """A cold start fills a fresh cache folder (converted records, measured columns); the warm start and the per-item
    phase on that folder find every file as the cold start left it (modification times before they started)."""
    for cold in phases(bench, "cold"):
        assert not cold["cache_hit"]
        written = set(cold["cache_written"])
        assert any(name.startswith("records/") and name.endswith(".arrow") for name in written)
        assert any(name.startswith("measure/") and name.endswith("done.json") for name in written)
        cache = Path(cold["cache_dir"])
        files = tool.cache_files(cache)
        assert set(files) == written  # nothing added later
        later = [p for p in phases(bench) if p["cache_dir"] == cold["cache_dir"] and p is not cold]
        for phase in later:
            assert phase["cache_hit"] and phase["cache_written"] == []
            assert max(files.values()) < phase["started_at"] * 1e9, f"{phase['name']} rewrote {cache}"
    reused = {p["cache_dir"] for p in phases(bench) if p["kind"] != "cold"}
    assert reused == {one(bench, "cold", SMALL)["cache_dir"], one(bench, "cold", LARGE, 2)["cache_dir"]}


def test_every_phase_of_a_set_plans_the_same_packs(bench):
    for size in (SMALL, LARGE):
        same = {p["packs"] for p in phases(bench) if p["size"] == size}
        assert len(same) == 1, (size, same)
    for phase in phases(bench):
        assert phase["steps"] == phase["packs"]  # one rank, micro-batch 1, one epoch


def test_step_estimate_equals_the_packs_iterated(bench):
    for phase in phases(bench, "items"):
        assert phase["greedy"]["iterated_packs"] == phase["steps"] == phase["packs"]
        assert phase["bfd"]["iterated_packs"] == phase["bfd"]["steps"] == phase["bfd"]["packs"]
        assert phase["bfd"]["dataset"] == "MLLMPackedDataset" and phase["dataset"] == "MLLMStreamingPackedDataset"
        for strategy in ("greedy", "bfd"):
            entry = phase[strategy]
            assert 0 < entry["items"] <= 40 and entry["records_per_item"] >= 1 and entry["per_item_s"] > 0


def test_sets_are_seeded_prefixes_with_the_promised_records(bench):
    """The smaller set is the larger one's prefix; image QA, text-only and multi-turn records are there, naming
    real image files of varied sizes."""
    sets = bench[2]["sets"]
    small = Path(sets[str(SMALL)]["path"]).read_text().splitlines()
    large = Path(sets[str(LARGE)]["path"]).read_text().splitlines()
    assert len(small) == SMALL and len(large) == LARGE and large[:SMALL] == small
    records = [json.loads(line) for line in large]
    with_image = [r for r in records if "image" in r]
    assert 0.5 * LARGE < len(with_image) < LARGE
    assert any(len(r["conversations"]) > 2 for r in records)
    root = Path(sets[str(LARGE)]["path"]).parent
    sizes = {Path(r["image"]).name.split("-")[1] for r in with_image}
    assert len(sizes) > 10
    assert all((root / r["image"]).is_file() and r["conversations"][0]["value"].startswith("<image>")
               for r in with_image)


def test_printed_rows_are_the_json_values(bench):
    lines = bench[1]
    rows = {m["name"]: m for m in map(ROW.match, lines) if m}
    assert set(rows) == {p["name"] for p in phases(bench)}
    for phase in phases(bench):
        row = rows[phase["name"]]
        assert int(row["size"].replace(",", "")) == phase["size"]
        assert row["cache"] == ("hit" if phase["cache_hit"] else "miss")
        for key, field in (("store", "store_s"), ("measure", "measure_s"), ("plan", "plan_s"), ("start", "start_s"),
                           ("cpu", "cpu_s"), ("load", "load_avg")):
            assert row[key] == f"{phase[field]:.2f}"
        assert row["packs"] == f"{phase['packs']:,}" and row["steps"] == f"{phase['steps']:,}"
        assert row["peak"] == f"{phase['peak_rss_bytes'] / MIB:.1f}"
        assert row["anon"] == f"{phase['anon_growth_bytes'] / MIB:.1f}"


def test_target_values_follow_from_the_phases(bench):
    targets = {t["name"]: t for t in bench[2]["targets"]}
    colds = [one(bench, "cold", LARGE, 1), one(bench, "cold", LARGE, 2)]
    warm = one(bench, "warm", LARGE)
    faster = min(colds, key=lambda p: p["start_s"])
    assert targets["warm_speedup"]["cold_workers"] == faster["workers"]
    assert targets["warm_speedup"]["value"] == pytest.approx(faster["start_s"] / warm["start_s"])
    assert targets["parallel_speedup"]["value"] == pytest.approx(colds[0]["measure_s"] / colds[1]["measure_s"])
    assert targets["warm_start"]["value"] == pytest.approx(warm["start_s"])
    assert targets["peak_rss"]["value"] == pytest.approx(warm["peak_rss_bytes"] / GIB)
    low = one(bench, "warm", SMALL)
    assert targets["anon_per_record"]["value"] == pytest.approx(
        (warm["anon_growth_bytes"] - low["anon_growth_bytes"]) / (LARGE - SMALL))
    items = {size: one(bench, "items", size) for size in (SMALL, LARGE)}
    ratios = {s: items[LARGE][s]["per_item_s"] / items[SMALL][s]["per_item_s"] for s in ("greedy", "bfd")}
    assert targets["item_ratio"]["ratios"] == pytest.approx(ratios)
    assert targets["item_ratio"]["value"] == pytest.approx(max(ratios.values()))


def test_printed_targets_and_verdicts_follow_from_the_json(bench):
    lines, saved = bench[1], bench[2]
    printed = {int(m["number"]): m for m in map(TARGET.match, lines) if m}
    assert sorted(printed) == [1, 2, 3, 4, 5, 6]
    higher_is_better = {"warm_speedup", "parallel_speedup"}
    strict = {"warm_start", "peak_rss", "anon_per_record"}
    for t in saved["targets"]:
        match = printed[t["number"]]
        value, limit = t["value"], t["limit"]
        assert value is not None, t["line"]
        if t["name"] in higher_is_better:
            expected = value >= limit
        else:
            expected = value < limit if t["name"] in strict else value <= limit
        assert t["ok"] == expected and match["verdict"] == ("OK" if expected else "MISS")
        assert f"  {t['line']}" == match.group(0)
        shown = {"warm_speedup": f"= {value:.1f}x", "parallel_speedup": f"= {value:.2f}x",
                 "warm_start": f"{value:.2f} s", "peak_rss": f"{value:.3f} GiB",
                 "anon_per_record": f"= {value:.1f} bytes/record", "item_ratio": f"worst {value:.2f}x"}[t["name"]]
        assert match["text"].endswith(shown)
        assert f"{limit:g}" in match["text"]
    checks = [m for m in map(CHECK.match, lines) if m]
    assert [m["verdict"] for m in checks] == ["OK" if c["ok"] else "MISS" for c in saved["checks"]] == ["OK"] * 3
    assert saved["ok"] == all(t["ok"] for t in saved["targets"] + saved["checks"])


def test_extrapolation_is_linear_through_the_two_sizes(bench, tool):
    extra = bench[2]["extrapolation"]
    low, high = one(bench, "warm", SMALL), one(bench, "warm", LARGE)
    entry = extra["warm_start_s"]
    slope = (high["start_s"] - low["start_s"]) / (LARGE - SMALL)
    assert entry["slope_per_record"] == pytest.approx(slope)
    assert entry["value"] == pytest.approx(high["start_s"] + slope * (tool.EXTRAPOLATE_TO - LARGE))
    cold = one(bench, "cold", LARGE, 2)
    assert extra["cold_measure_s"]["slope_per_record"] == pytest.approx(
        (cold["measure_s"] - one(bench, "cold", SMALL)["measure_s"]) / (LARGE - SMALL))
    line = next(line for line in bench[1] if line.startswith("extrapolated to"))
    assert f"warm start {entry['value']:.0f} s" in line


def test_a_failed_phase_is_a_row_and_a_miss(tool, capsys):
    """A phase that failed prints as a row and makes every target needing it a MISS, naming it."""
    args = tool.parse_args(["--sizes", "10", "20", "--parallel-size", "20", "--workdir", "/nowhere"])
    failed = [{"name": phase.name, "kind": phase.kind, "size": phase.size, "workers": phase.workers,
               "cache_dir": phase.cache, "error": "exit code 1: boom"}
              for phase in tool.plan_phases(args.sizes, args.parallel_size)]
    result = tool.report(args, {}, failed, 0.0)
    assert not result["ok"] and not any(t["ok"] for t in result["targets"])
    assert all("failed: exit code 1: boom" in t["line"] for t in result["targets"])
    assert "cold-1w-20                 20 failed: exit code 1: boom" in capsys.readouterr().out


def test_skip_1m_uses_the_parallel_size_as_the_largest(tool):
    assert tool.parse_args(["--skip-1m"]).sizes == [100_000, 200_000]
    assert tool.parse_args([]).sizes == [100_000, 1_000_000]
