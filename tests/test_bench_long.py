"""tools/bench_long.py on a tiny setting: the table is complete and its numbers agree with each other.

Wall-clock values and memory sizes are never asserted (they depend on the machine and its load); only relations
that hold whatever they are: one row per backend and length, each step the best of its repeats, ratios computed
from the steps, target verdicts consistent with the printed values, the JSON file holding what was printed,
failed measurements printed as rows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_long.py"
LENGTHS = (256, 512)
BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")
TINY = ["--lengths", *map(str, LENGTHS), "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--segment-median", "64", "--repeats", "1"]
MIB, GIB = 2**20, 2**30

ROW = re.compile(r"^(?P<backend>[\w-]+)\s+(?P<length>\d+)\s+(?:(?P<step>[\d.]+)\s+(?P<peak>[\d.]+)\s+"
                 r"(?P<ratio>[\d.]+|-)|failed: (?P<error>.+))$")
TARGET_PEAK = re.compile(r"^\s+\(1\) peak added memory at L=(?P<length>\d+) <= (?P<limit>[\d.]+) GiB: "
                         r"(?:(?P<value>[\d.]+) GiB|(?P<why>.+)) -> (?P<verdict>OK|MISS)$")
TARGET_GROWTH = re.compile(r"^\s+\(2\) linear memory growth: peak\(L=(?P<high>\d+)\) / peak\(L=(?P<low>\d+)\) <= "
                           r"(?P<slack>[\d.]+) x (?P=high)/(?P=low) = (?P<bound>[\d.]+): "
                           r"(?:(?P<value>[\d.]+)|(?P<why>.+)) -> (?P<verdict>OK|MISS)$")
TARGET_STEP = re.compile(r"^\s+\(3\) step <= (?P<limit>[\d.]+)x the sum of one-by-one steps at every L: "
                         r"(?P<parts>.*?)(?:; worst (?P<worst>[\d.]+)x)? -> (?P<verdict>OK|MISS)$")


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_long", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(tool, argv: list[str]) -> tuple[dict, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = tool.main(argv)
    return result, out.getvalue().splitlines()


@pytest.fixture(scope="module")
def tool():
    return load_tool()


@pytest.fixture(scope="module")
def bench(tool, tmp_path_factory):
    """One tiny run of the tool: its returned dict, its printed lines and its JSON file."""
    path = tmp_path_factory.mktemp("bench_long") / "bench.json"
    result, lines = run(tool, [*TINY, "--backends", *BACKENDS, "--json", str(path)])
    return result, lines, json.loads(path.read_text())


def printed_rows(lines: list[str]) -> dict[tuple[str, int], dict]:
    rows: dict[tuple[str, int], dict] = {}
    for match in filter(None, map(ROW.match, lines)):
        key = (match["backend"], int(match["length"]))
        assert key not in rows, f"two rows for {key}"
        rows[key] = match.groupdict()
    return rows


def matching(pattern: re.Pattern, lines: list[str]) -> re.Match:
    found = [m for m in map(pattern.match, lines) if m]
    assert len(found) == 1, f"expected one line matching {pattern.pattern}"
    return found[0]


def test_every_backend_is_measured_or_skipped_with_its_reason(bench):
    result, lines, _ = bench
    assert set(result["backends"]) | set(result["skipped"]) == set(BACKENDS)
    assert not set(result["backends"]) & set(result["skipped"])
    assert {"eager", "sdpa", "sdpa_varlen"} <= set(result["backends"])
    if not torch.cuda.is_available():
        assert "flash_attention_2" in result["skipped"]
    for name, reason in result["skipped"].items():
        assert f"skipped {name}: {reason}" in lines


def test_one_row_per_backend_and_length_plus_the_reference(bench):
    result, lines, _ = bench
    expected = {(name, length) for name in ("one-by-one", *result["backends"]) for length in LENGTHS}
    assert set(printed_rows(lines)) == expected
    assert [(r["backend"], r["length"]) for r in result["rows"]] == [
        (name, length) for length in LENGTHS for name in result["backends"]]
    assert [r["length"] for r in result["references"]] == list(LENGTHS)


def test_rows_fill_the_length_with_the_same_segment_mix(bench, tool):
    result, _, _ = bench
    for length in LENGTHS:
        segments = result["segments"][str(length)]
        assert sum(segments) == length and min(segments) >= tool.MIN_SEGMENT
        assert segments == tool.segment_lengths(length, 64, 0.5, 4096, 0)
    for row in result["rows"] + result["references"]:
        assert row["tokens"] == row["length"]
    shorter, longer = result["segments"][str(LENGTHS[0])], result["segments"][str(LENGTHS[1])]
    assert longer[: len(shorter) - 1] == shorter[:-1]  # the same stream; only the shorter row's last one is cut


def test_steps_are_the_best_of_the_repeats(bench):
    result, _, _ = bench
    for row in result["rows"] + result["references"]:
        assert "error" not in row, row
        assert len(row["times_s"]) == 1
        assert row["step_s"] == min(row["times_s"]) > 0
        assert row["baseline_rss_bytes"] > 0 and isinstance(row["peak_added_bytes"], int)
        assert row["threads"] == 1


def test_printed_numbers_and_ratios_follow_from_the_measurements(bench):
    result, lines, _ = bench
    printed = printed_rows(lines)
    references = {r["length"]: r for r in result["references"]}
    for row in result["rows"] + result["references"]:
        line = printed[(row["backend"], row["length"])]
        assert line["step"] == f"{row['step_s']:.4f}"
        assert line["peak"] == f"{row['peak_added_bytes'] / MIB:.1f}"
    for row in result["rows"]:
        reference = references[row["length"]]
        assert row["ratio"] == pytest.approx(row["step_s"] / reference["step_s"], rel=1e-12)
        assert printed[(row["backend"], row["length"])]["ratio"] == f"{row['ratio']:.3f}"
    assert all(printed[("one-by-one", length)]["ratio"] == "-" for length in LENGTHS)


def test_target_verdicts_agree_with_the_printed_values(bench):
    result, lines, _ = bench
    assert result["default_backend"] == "sdpa_varlen"
    rows = {r["length"]: r for r in result["rows"] if r["backend"] == "sdpa_varlen"}
    low, high = min(LENGTHS), max(LENGTHS)
    peak, growth, step = result["targets"]

    line = matching(TARGET_PEAK, lines)
    assert int(line["length"]) == high and float(line["limit"]) == peak["limit"] == 2.5
    assert peak["value"] == pytest.approx(rows[high]["peak_added_bytes"] / GIB)
    assert line["value"] == f"{peak['value']:.3f}"
    assert line["verdict"] == ("OK" if peak["value"] <= peak["limit"] else "MISS") == ("OK" if peak["ok"] else "MISS")

    line = matching(TARGET_GROWTH, lines)
    assert (int(line["low"]), int(line["high"]), float(line["slack"])) == (low, high, 1.5)
    assert growth["limit"] == pytest.approx(1.5 * high / low) == float(line["bound"])
    assert growth["value"] == pytest.approx(rows[high]["peak_added_bytes"] / rows[low]["peak_added_bytes"])
    assert line["value"] == f"{growth['value']:.3f}"
    assert line["verdict"] == ("OK" if growth["value"] <= growth["limit"] else "MISS")
    assert growth["ok"] == (line["verdict"] == "OK")

    line = matching(TARGET_STEP, lines)
    assert float(line["limit"]) == step["limit"] == 1.3
    parts = dict(re.findall(r"L=(\d+) ([\d.]+)x", line["parts"]))
    assert {int(k) for k in parts} == set(LENGTHS)
    for length, ratio in parts.items():
        assert ratio == f"{rows[int(length)]['ratio']:.3f}"
    assert step["value"] == max(rows[length]["ratio"] for length in LENGTHS)
    assert line["worst"] == f"{step['value']:.3f}"
    assert line["verdict"] == ("OK" if step["value"] <= step["limit"] else "MISS")
    assert step["ok"] == (line["verdict"] == "OK")

    assert result["ok"] == all(t["ok"] for t in result["targets"])


def test_json_holds_what_was_printed(bench):
    result, lines, data = bench
    assert data == json.loads(json.dumps(result, default=str))
    assert data["lines"] == lines


def test_a_failed_measurement_is_a_row_and_a_miss_not_a_crash(tool):
    result, lines = run(tool, [*TINY, "--backends", "sdpa_varlen", "--memory-limit-gib", "0.01"])
    printed = printed_rows(lines)
    assert set(printed) == {(name, length) for name in ("one-by-one", "sdpa_varlen") for length in LENGTHS}
    for name in ("one-by-one", "sdpa_varlen"):
        assert "over the --memory-limit-gib" in printed[(name, LENGTHS[0])]["error"]
        assert printed[(name, LENGTHS[1])]["error"] == f"not run: failed at L={LENGTHS[0]} already"
    assert all(row["ratio"] is None for row in result["rows"])
    assert not any(t["ok"] for t in result["targets"]) and not result["ok"]
    assert sum(line.endswith("-> MISS") for line in lines) == 3


def test_segment_lengths_fill_the_row_and_share_one_stream(tool):
    for length in (64, 100, 4096, 32768):
        segments = tool.segment_lengths(length, 700, 0.5, 4096, 0)
        assert sum(segments) == length and min(segments) >= tool.MIN_SEGMENT
        assert max(segments) <= max(length, 4096 + tool.MIN_SEGMENT)
    short, long = (tool.segment_lengths(n, 700, 0.5, 4096, 0) for n in (8192, 32768))
    assert long[: len(short) - 1] == short[:-1]
    assert tool.mrope_section(64) == [8, 12, 12] and tool.mrope_section(128) == [16, 24, 24]
