"""tools/bench_train.py on a tiny setting: the table is complete and its numbers agree with each other.

Wall-clock values are never asserted (they depend on the machine and its load); only relations that hold
whatever the timings are: the same data trained in every mode, rates consistent with the printed counts and
seconds, ratios computed from the printed rates, verdicts consistent with the ratios, step counts that follow
from packs and micro-batch sizes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_train.py"
SAMPLES = 40
MICRO_BATCH = 4
MAX_SEQ_LEN = 1024

ROW = re.compile(
    r"^(?P<mode>\w+)\s+micro-batch (?P<micro_batch>\d+) (?:samples|x (?P<width>\d+))\s+steps\s+(?P<steps>\d+)\s+"
    r"samples\s+(?P<samples>\d+)\s+effective tokens\s+(?P<effective>\d+)\s+padding\s+(?P<padding>[\d.]+)%\s+"
    r"seconds\s+(?P<seconds>[\d.]+)\s+tokens/s\s+(?P<tps>[\d.]+)\s+samples/s\s+(?P<sps>[\d.]+)\s+"
    r"step tokens/s\s+(?P<step_tps>[\d.]+)$"
)
RATIO = re.compile(
    r"^(?P<mode>\w+)/padded effective tokens/s: (?P<ratio>[\d.]+)x \(target >= (?P<target>[\d.]+)x\) -> "
    r"(?P<verdict>OK|MISS); step tokens/s (?P<step_ratio>[\d.]+)x$"
)


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """One tiny run of the tool: its returned dict and its printed lines."""
    tool = load_tool()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = tool.main(["--samples", str(SAMPLES), "--micro-batch", str(MICRO_BATCH), "--max-seq-len",
                            str(MAX_SEQ_LEN), "--repeats", "1"])
    return tool, result, out.getvalue().splitlines()


def parsed_rows(lines: list[str]) -> dict[str, dict]:
    rows = {}
    for line in lines:
        match = ROW.match(line)
        if match:
            rows[match["mode"]] = match.groupdict()
    return rows


def parsed_ratios(lines: list[str]) -> dict[str, dict]:
    return {m["mode"]: m.groupdict() for m in map(RATIO.match, lines) if m}


def test_prints_one_row_per_mode_and_one_ratio_line_per_strategy(bench):
    _, result, lines = bench
    assert list(parsed_rows(lines)) == ["padded", "greedy", "bfd"]
    assert list(parsed_ratios(lines)) == ["greedy", "bfd"]
    assert [r["mode"] for r in result["results"]] == ["padded", "greedy", "bfd"]
    assert set(result) >= {"results", "ratios", "step_ratios", "target", "ok", "seconds"}


def test_every_mode_trains_the_same_data(bench):
    _, result, lines = bench
    rows = parsed_rows(lines)
    assert len({(r["samples"], r["effective"]) for r in rows.values()}) == 1
    assert len({(r["samples"], r["effective_tokens"], r["dropped"]) for r in result["results"]}) == 1
    padded = result["results"][0]
    assert 0 < padded["samples"] <= SAMPLES
    assert padded["samples"] + padded["dropped"] == SAMPLES


def test_rates_follow_from_counts_and_seconds(bench):
    _, result, _ = bench
    for r in result["results"]:
        assert r["tokens_per_s"] == pytest.approx(r["effective_tokens"] / r["seconds"], rel=1e-9)
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["seconds"], rel=1e-9)
        assert r["step_tokens_per_s"] == pytest.approx(r["effective_tokens"] / r["step_seconds"], rel=1e-9)
        assert 0 < r["step_seconds"] <= r["seconds"]


def test_printed_ratios_are_computed_from_printed_rates(bench):
    _, result, lines = bench
    rows, ratios = parsed_rows(lines), parsed_ratios(lines)
    padded_tps, padded_step = float(rows["padded"]["tps"]), float(rows["padded"]["step_tps"])
    by_mode = {r["mode"]: r for r in result["results"]}
    for mode, line in ratios.items():
        # rates are printed with 1 decimal, ratios with 3: allow for both roundings
        assert float(line["ratio"]) == pytest.approx(float(rows[mode]["tps"]) / padded_tps, abs=2e-3)
        assert float(line["step_ratio"]) == pytest.approx(float(rows[mode]["step_tps"]) / padded_step, abs=2e-3)
        expected = by_mode[mode]["tokens_per_s"] / by_mode["padded"]["tokens_per_s"]
        assert result["ratios"][mode] == pytest.approx(expected)
        assert float(line["target"]) == result["target"]
        assert line["verdict"] == ("OK" if result["ratios"][mode] >= result["target"] else "MISS")
    assert result["ok"] == all(line["verdict"] == "OK" for line in ratios.values())


def test_micro_batches_match_the_token_budget_rule_and_give_the_step_counts(bench):
    tool, result, lines = bench
    padded, *packed = result["results"]
    assert padded["micro_batch"] == MICRO_BATCH
    assert padded["packs"] == padded["samples"]  # unpacked: one sample per row
    assert padded["steps"] == math.ceil(padded["samples"] / MICRO_BATCH)
    rows = max(1, round(padded["slots"] / padded["batches"] / MAX_SEQ_LEN))
    for r in packed:
        assert r["micro_batch"] == rows == tool.packed_micro_batch(padded, MAX_SEQ_LEN)
        assert r["steps"] == math.ceil(r["packs"] / rows)
        assert r["packs"] < r["samples"]  # several samples per pack
        assert r["padding_ratio"] <= padded["padding_ratio"]
    assert all(row["width"] == str(MAX_SEQ_LEN) for mode, row in parsed_rows(lines).items() if mode != "padded")


def test_padding_ratio_is_what_the_slots_say(bench):
    _, result, lines = bench
    rows = parsed_rows(lines)
    for r in result["results"]:
        assert r["padding_ratio"] == pytest.approx(1 - r["effective_tokens"] / r["slots"])
        assert float(rows[r["mode"]]["padding"]) == pytest.approx(100 * r["padding_ratio"], abs=0.051)
