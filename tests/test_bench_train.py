"""tools/bench_train.py on a tiny setting: every mode trains the same samples, batches follow their rules, and the
printed ratios and verdicts follow from the printed numbers.

Wall-clock values are never asserted (they depend on the machine and its load); only relations that hold whatever
the timings are. One L below 2048 and one at 2048, so both sets of targets are printed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_train.py"
SAMPLES = 40
MICRO_BATCH = 4
LENGTHS = (512, 2048)
SEED = 0
BASELINES = ["random", "group_by_length", "token_budget", "token_budget_varlen"]

HEADER = re.compile(r"^L=(?P<length>\d+): (?P<admitted>\d+) samples .*token budget (?P<rows>\d+) x \d+ = "
                    r"(?P<budget>\d+) per micro-batch$")
ROW = re.compile(r"^  (?P<label>\([abc]'?\)|packed) (?P<mode>\S+)\s+(?P<attention>\S+)\s+(?P<call>prepare_\w+)\s+"
                 r"(?P<steps>\d+)\s+(?P<rows>[\d.]+)\s+(?P<padding>[\d.]+)%\s+(?P<seconds>[\d.]+)\s+(?P<tps>[\d.]+)$")
RATIO = re.compile(r"^  (?P<mode>\w+/\w+)\s+(?P<values>[\d.]+x(?:\s+[\d.]+x)*)$")
TARGET = re.compile(r"^target L=(?P<length>\d+): (?P<mode>\S+) >= (?P<limit>[\d.]+)x \((?P<label>[abc]'?)\) "
                    r"(?P<base>\w+): (?P<value>[\d.]+)x -> (?P<verdict>OK|MISS)$")


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """One tiny run of the tool: the module, its returned dict and its printed lines."""
    tool = load_tool()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = tool.main(["--samples", str(SAMPLES), "--micro-batch", str(MICRO_BATCH), "--repeats", "1",
                            "--seed", str(SEED), "--lengths", *map(str, LENGTHS)])
    return tool, result, out.getvalue().splitlines()


def printed_tables(lines: list[str]) -> dict[int, dict]:
    """Per L: its header, its mode rows and its ratio rows, as printed."""
    tables: dict[int, dict] = {}
    current = None
    for line in lines:
        if match := HEADER.match(line):
            current = tables[int(match["length"])] = {"header": match.groupdict(), "rows": {}, "ratios": {}}
        elif current is not None and (match := ROW.match(line)):
            current["rows"][match["mode"]] = match.groupdict()
        elif current is not None and (match := RATIO.match(line)):
            current["ratios"][match["mode"]] = [float(v) for v in match["values"].replace("x", " ").split()]
    return tables


def trained(mode: dict) -> list[int]:
    return sorted(i for batch in mode["batches"] for row in batch for i in row)


def by_mode(measured: dict) -> dict[str, dict]:
    return {r["mode"]: r for r in measured["results"]}


def test_prints_every_mode_at_every_length(bench):
    _, result, lines = bench
    tables = printed_tables(lines)
    assert sorted(tables) == list(LENGTHS) == [m["length"] for m in result["lengths"]]
    backend = result["default_backend"]
    packed = [f"{strategy}/{b}" for strategy in ("greedy", "bfd") for b in dict.fromkeys([backend, "sdpa_varlen",
                                                                                          "sdpa"])]
    for measured in result["lengths"]:
        table = tables[measured["length"]]
        assert list(table["rows"]) == BASELINES + packed == [r["mode"] for r in measured["results"]]
        assert list(table["ratios"]) == packed
        assert [r["label"] for r in table["rows"].values()] == ["(a)", "(b)", "(c)", "(c')"] + ["packed"] * 4


def test_every_mode_trains_the_same_samples_once(bench):
    _, result, _ = bench
    for measured in result["lengths"]:
        admitted = measured["admitted"]
        assert admitted + measured["dropped"] == SAMPLES
        assert all(n <= measured["length"] for n in measured["sample_lengths"])
        for r in measured["results"]:
            assert trained(r) == list(range(admitted)), r["mode"]
            assert r["samples"] == admitted
        assert len({r["effective_tokens"] for r in measured["results"]}) == 1
        assert measured["results"][0]["effective_tokens"] == sum(measured["sample_lengths"])


def test_padded_baselines_follow_their_batching_rules(bench):
    _, result, _ = bench
    for measured in result["lengths"]:
        modes, lengths = by_mode(measured), measured["sample_lengths"]
        random = [[row[0] for row in batch] for batch in modes["random"]["batches"]]
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(SEED)).tolist()
        assert [i for batch in random for i in batch] == order
        grouped = [[row[0] for row in batch] for batch in modes["group_by_length"]["batches"]]
        expected = get_length_grouped_indices(lengths, MICRO_BATCH, mega_batch_mult=50,
                                              generator=torch.Generator().manual_seed(SEED))
        assert [i for batch in grouped for i in batch] == expected
        for batches in (random, grouped):
            assert all(len(batch) == MICRO_BATCH for batch in batches[:-1])
            assert 0 < len(batches[-1]) <= MICRO_BATCH
        assert all(len(row) == 1 for r in measured["results"][:4] for batch in r["batches"] for row in batch)


def test_token_budget_batches_respect_the_budget_and_are_length_sorted(bench):
    _, result, lines = bench
    tables = printed_tables(lines)
    for measured in result["lengths"]:
        modes, lengths, budget = by_mode(measured), measured["sample_lengths"], measured["budget"]
        slots = [len(batch) * max(lengths[row[0]] for row in batch) for batch in modes["random"]["batches"]]
        assert measured["rows"] == max(1, round(sum(slots) / len(slots) / measured["length"]))
        assert budget == measured["rows"] * measured["length"]
        assert int(tables[measured["length"]]["header"]["budget"]) == budget
        batches = [[row[0] for row in batch] for batch in modes["token_budget"]["batches"]]
        assert modes["token_budget_varlen"]["batches"] == modes["token_budget"]["batches"]
        for batch in batches:
            assert len(batch) * max(lengths[i] for i in batch) <= budget
        # length-sorted: laid out longest batch first, the lengths never increase; each batch is as full as allowed
        laid_out = sorted(batches, key=lambda batch: -lengths[batch[0]])
        flat = [lengths[i] for batch in laid_out for i in batch]
        assert flat == sorted(flat, reverse=True)
        for batch, following in zip(laid_out, laid_out[1:]):
            assert (len(batch) + 1) * lengths[batch[0]] > budget
            assert lengths[following[0]] <= lengths[batch[-1]]


def test_packed_modes_fill_at_most_the_budget(bench):
    _, result, _ = bench
    for measured in result["lengths"]:
        lengths = measured["sample_lengths"]
        for r in measured["results"][4:]:
            assert r["call"] == "prepare_packed" and r["attention"] == r["mode"].split("/")[1]
            assert all(len(batch) <= measured["rows"] for batch in r["batches"])
            assert all(sum(lengths[i] for i in row) <= measured["length"] for batch in r["batches"] for row in batch)
            assert r["padding_ratio"] <= by_mode(measured)["random"]["padding_ratio"]


def test_rates_and_padding_follow_from_the_counts(bench):
    _, result, lines = bench
    tables = printed_tables(lines)
    for measured in result["lengths"]:
        rows = tables[measured["length"]]["rows"]
        for r in measured["results"]:
            assert r["tokens_per_s"] == pytest.approx(r["effective_tokens"] / r["seconds"], rel=1e-12)
            assert r["padding_ratio"] == pytest.approx(1 - r["effective_tokens"] / r["slots"], rel=1e-12)
            assert r["steps"] == len(r["batches"]) == int(rows[r["mode"]]["steps"])
            assert float(rows[r["mode"]]["tps"]) == pytest.approx(r["tokens_per_s"], abs=0.051)
            assert float(rows[r["mode"]]["padding"]) == pytest.approx(100 * r["padding_ratio"], abs=0.051)


def test_printed_ratios_are_computed_from_printed_rates(bench):
    _, result, lines = bench
    tables = printed_tables(lines)
    for measured in result["lengths"]:
        table, modes = tables[measured["length"]], by_mode(measured)
        for mode, printed in table["ratios"].items():
            tps = float(table["rows"][mode]["tps"])
            for base, value in zip(BASELINES, printed):
                # rates are printed with 1 decimal, ratios with 3: allow for both roundings
                assert value == pytest.approx(tps / float(table["rows"][base]["tps"]), abs=2e-3)
                exact = modes[mode]["tokens_per_s"] / modes[base]["tokens_per_s"]
                assert measured["ratios"][mode][base] == pytest.approx(exact, rel=1e-12)


def test_summary_repeats_the_tables(bench):
    _, result, lines = bench
    start = lines.index("summary, effective tokens/s:")
    names = lines[start + 1].split()[1:]
    assert names == [r["mode"] for r in result["lengths"][0]["results"]]
    for offset, measured in enumerate(result["lengths"]):
        length, *rates = lines[start + 2 + offset].split()
        assert int(length) == measured["length"]
        assert [float(v) for v in rates] == pytest.approx([r["tokens_per_s"] for r in measured["results"]], abs=0.051)


def test_targets_and_verdicts_agree_with_the_values(bench):
    _, result, lines = bench
    printed = [m.groupdict() for m in map(TARGET.match, lines) if m]
    expected = [(length, base, limit) for length in LENGTHS
                for base, limit in ((("token_budget", 1.10), ("group_by_length", 1.5), ("token_budget_varlen", 1.0))
                                    if length >= 2048 else (("token_budget", 1.0), ("token_budget_varlen", 1.0)))]
    assert [(int(p["length"]), p["base"], float(p["limit"])) for p in printed] == expected
    assert len(result["targets"]) == len(printed)
    assert result["target_mode"] == f"bfd/{result['default_backend']}"
    for line, target in zip(printed, result["targets"]):
        measured = next(m for m in result["lengths"] if m["length"] == int(line["length"]))
        assert line["mode"] == target["mode"] == result["target_mode"]
        assert target["value"] == measured["ratios"][target["mode"]][target["baseline"]]
        assert float(line["value"]) == pytest.approx(target["value"], abs=5e-4)
        assert line["verdict"] == ("OK" if target["value"] >= target["limit"] else "MISS")
        assert target["ok"] == (line["verdict"] == "OK")
    assert result["ok"] == all(p["verdict"] == "OK" for p in printed)
