"""tools/bench_long.py: what it computes, on tiny inputs.

Checked: the rows share one segment stream and fill their length; the one-by-one reference does the packed step's
work (same loss and gradients); a step's time is the best of its timed repeats after the memory step and a warm-up;
the peak sampler sees an allocation; a measurement over its memory or time limit is killed and named; a backend
that failed is not run at larger lengths and ratios come from the reference; OK/MISS are decided by the targets. One
tiny run of the command (its ``main``, in this process) returns and writes its numbers. Wall-clock values are never
asserted.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mvp_engine.engine.testkit.runs import spawn_on_pool
from tools import bench_long as bench

TINY = ["--lengths", "128", "256", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--segment-median", "48", "--repeats", "1"]
GIB, MIB = 2**30, 2**20


def test_segment_lengths_fill_the_row_and_share_one_stream():
    for length in (64, 100, 4096, 32768):
        segments = bench.segment_lengths(length, 700, 0.5, 4096, 0)
        assert sum(segments) == length and min(segments) >= bench.MIN_SEGMENT
        assert max(segments) <= max(length, 4096 + bench.MIN_SEGMENT)
    short, long = (bench.segment_lengths(n, 700, 0.5, 4096, 0) for n in (8192, 32768))
    assert long[: len(short) - 1] == short[:-1]  # the same stream; only the shorter row's last one is cut
    assert bench.mrope_section(64) == [8, 12, 12] and bench.mrope_section(128) == [16, 24, 24]


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_varlen"])
def test_the_one_by_one_pass_does_the_packed_steps_work(backend):
    """Same samples, same weights: the packed step and the one-by-one pass reach the same gradients."""
    recipe, model_cfg = bench.load_recipe(bench.RECIPE), bench.model_config(bench.parse_args(TINY))
    packed = recipe.build_model(model_cfg, backend).train()
    alone = recipe.build_model(model_cfg, bench.REFERENCE_BACKEND).train()
    pad = packed.config.text_config.pad_token_id
    samples = bench.make_samples([40, 56, 32], packed.config, seed=0)
    assert [s.length for s in samples] == [40, 56, 32]
    ids = bench.ordinary_token_ids(packed.config)
    assert all(bool(torch.isin(s.input_ids, ids).all()) and torch.equal(s.labels, s.input_ids) for s in samples)
    row = bench.collate(samples, pad)
    bench.packed_step(recipe, packed, row, backend)
    bench.one_by_one_pass(recipe, alone, [bench.collate([s], pad) for s in samples], bench.supervised_targets(row))
    reference = dict(alone.named_parameters())
    checked = 0
    for name, param in packed.named_parameters():
        assert (param.grad is None) == (reference[name].grad is None), name
        if param.grad is not None:
            torch.testing.assert_close(param.grad, reference[name].grad, rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
    assert checked > 0


class CountingModel:
    def __init__(self):
        self.zeroed = 0

    def zero_grad(self, set_to_none: bool = True):
        self.zeroed += 1


def test_a_step_is_the_best_of_its_timed_repeats_with_fresh_gradients():
    """The first run measures memory, the next is an untimed warm-up, the fastest of the rest counts."""
    seconds = iter([5.0, 9.0, 3.0, 2.0, 4.0])
    model = CountingModel()
    result = bench.measured_runs(model, lambda: next(seconds), repeats=3, started=time.monotonic(), timeout_s=0)
    assert (result["memory_step_s"], result["warmup_s"], result["times_s"], result["step_s"]) == (
        5.0, 9.0, [3.0, 2.0, 4.0], 2.0)
    assert model.zeroed == 5  # gradients set to None before every run, as an optimizer's zero_grad does
    with pytest.raises(TimeoutError, match="would pass the --timeout-s 60 s limit"):
        bench.measured_runs(CountingModel(), lambda: 30.0, repeats=2, started=time.monotonic(), timeout_s=60)


def test_the_peak_sampler_sees_an_allocation():
    """64 MiB written into a fresh anonymous mapping: a heap allocation may instead reuse memory this process
    already holds (freed by earlier in-process tests), which no RSS sampler could see."""
    with bench.PeakRss() as rss:
        held = mmap.mmap(-1, 64 * MIB)
        pages = np.frombuffer(held, dtype=np.uint8)
        pages[:] = 1
        time.sleep(0.05)
    assert rss.added >= 48 * MIB and rss.baseline > 0
    del pages
    held.close()


class Child:
    """A plain ``python -c`` process behind the part of ``multiprocessing.Process`` that ``watch`` uses."""

    def __init__(self, code: str):
        self.popen = subprocess.Popen([sys.executable, "-c", code])
        self.pid = self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


@pytest.mark.parametrize("limit_gib,timeout_s,reason", [(0.2, 60, "RSS"), (16, 0.5, "over the --timeout-s 0.5 s")])
def test_a_measurement_over_its_limits_is_killed_and_named(limit_gib, timeout_s, reason):
    """A fresh interpreter (~20 MiB) that then holds 512 MiB: over 0.2 GiB it is killed for memory; with room for
    it, the time limit stops it."""
    child = Child("import time; held = bytearray(512 * 2**20); time.sleep(60)")
    why = bench.watch(child, int(limit_gib * GIB), timeout_s)
    assert why is not None and why.startswith(reason) and why.endswith("killed"), why
    assert not child.is_alive()


def test_backends_this_machine_cannot_train_with_are_skipped_with_the_reason():
    """Also on a CUDA machine: this test runs as on the CPU (conftest), and the tool asks the engine's device choice."""
    runnable, skipped = bench.runnable_backends(["sdpa", "flash_attention_2", "sdpa", "sdpa_varlen"])
    assert runnable == ["sdpa", "sdpa_varlen"] and list(skipped) == ["flash_attention_2"]
    assert "CUDA" in skipped["flash_attention_2"]


def test_a_failed_backend_is_not_run_again_and_ratios_come_from_the_reference():
    calls = []

    def measure_one(name, length):
        calls.append((name, length))
        if name == "eager" and length == 256:
            return {"error": "MemoryError"}
        return {"step_s": {"one-by-one": 2.0, "eager": 3.0, "sdpa_varlen": 1.0}[name] * length / 128}

    rows, references = bench.run_all([128, 256, 512], ["eager", "sdpa_varlen"], measure_one)
    assert calls == [(n, length) for length in (128, 256) for n in ("one-by-one", "eager", "sdpa_varlen")] + [
        ("one-by-one", 512), ("sdpa_varlen", 512)]
    by = {(r["backend"], r["length"]): r for r in rows}
    assert by[("eager", 512)]["error"] == "not run: failed at L=256 already" and by[("eager", 512)]["ratio"] is None
    assert by[("eager", 128)]["ratio"] == pytest.approx(1.5) and by[("sdpa_varlen", 512)]["ratio"] == 0.5
    assert sorted(references) == [128, 256, 512]
    rows, _ = bench.run_all([128], ["sdpa_varlen"], lambda name, _: {"error": "x"} if name == "one-by-one" else
                            {"step_s": 1.0})
    assert rows[0]["ratio"] is None  # no reference, no ratio


def rows_of(peaks: dict[int, float], ratios: dict[int, float], backend: str = "sdpa_varlen") -> list[dict]:
    return [{"backend": backend, "length": n, "peak_added_bytes": int(peaks[n] * GIB), "ratio": ratios[n],
             "step_s": ratios[n]} for n in peaks]


REFERENCES = {n: {"backend": "one-by-one", "length": n, "step_s": 1.0} for n in (4096, 32768)}


@pytest.mark.parametrize("peaks,ratios,expected", [
    ({4096: 0.2, 32768: 2.3}, {4096: 1.0, 32768: 1.3}, [True, True, True]),  # growth 11.5 <= 1.5 x 8
    ({4096: 0.25, 32768: 2.6}, {4096: 1.0, 32768: 1.2}, [False, True, True]),  # over 2.5 GiB
    ({4096: 0.1, 32768: 2.4}, {4096: 1.0, 32768: 1.2}, [True, False, True]),  # growth 24 > 12: quadratic
    ({4096: 0.2, 32768: 2.3}, {4096: 1.31, 32768: 1.0}, [True, True, False]),  # one length over 1.3x
])
def test_ok_and_miss_are_decided_by_the_targets(peaks, ratios, expected):
    lengths = sorted(peaks)
    targets = bench.targets_for("sdpa_varlen", rows_of(peaks, ratios), REFERENCES, {}, lengths)
    assert [t["ok"] for t in targets] == expected
    peak, growth, step = targets
    assert peak["value"] == pytest.approx(peaks[32768]) and growth["limit"] == pytest.approx(1.5 * 8)
    assert growth["value"] == pytest.approx(peaks[32768] / peaks[4096]) and step["value"] == max(ratios.values())
    assert [t["line"].endswith("OK" if ok else "MISS") for t, ok in zip(targets, expected)] == [True] * 3


def test_a_missing_or_failed_measurement_is_a_miss_naming_why():
    lengths = [4096, 32768]
    failed = rows_of({4096: 0.2, 32768: 1.0}, {4096: 1.0, 32768: 1.0})
    failed[1] = {"backend": "sdpa_varlen", "length": 32768, "error": "killed by signal 9", "ratio": None}
    targets = bench.targets_for("sdpa_varlen", failed, REFERENCES, {}, lengths)
    assert not any(t["ok"] for t in targets)
    assert all("sdpa_varlen failed at L=32768: killed by signal 9" in t["line"] for t in targets)
    skipped = bench.targets_for("flash_attention_2", [], REFERENCES, {"flash_attention_2": "needs CUDA"}, lengths)
    assert all(not t["ok"] and "not measured (needs CUDA)" in t["line"] for t in skipped)
    one_length = bench.targets_for("sdpa_varlen", failed[:1], REFERENCES, {}, [4096])
    assert not one_length[1]["ok"] and "needs two lengths" in one_length[1]["line"]


@pytest.mark.launch
def test_the_command_measures_every_length_and_exits_0(tmp_path, monkeypatch, capfd):
    """The command's ``main`` with its arguments, in this process (a fresh interpreter for it cost ~8 s of imports;
    each measurement is still its own process, forked from the fork server), on a tiny model, one backend."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bench.json"
    returned = bench.main([*TINY, "--backends", "sdpa_varlen", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["lines"] == returned["lines"] == capfd.readouterr().out.splitlines()
    assert [(r["backend"], r["length"]) for r in result["rows"]] == [("sdpa_varlen", 128), ("sdpa_varlen", 256)]
    for row in result["rows"] + result["references"]:
        assert "error" not in row, row
        assert row["tokens"] == row["length"] and row["threads"] == 1
        assert row["step_s"] == min(row["times_s"]) > 0 and len(row["times_s"]) == 1
    for row, reference in zip(result["rows"], result["references"]):
        assert row["ratio"] == pytest.approx(row["step_s"] / reference["step_s"])


def test_cp_targets_judge_saved_bytes_and_vision_at_8192_and_growth():
    def row(length, cp, saved, vision):
        return {"backend": "sdpa_varlen", "length": length, "cp": cp, "saved_bytes": saved, "vision_flops": vision}

    rows = [row(4096, 1, 100, 10), row(4096, 2, 70, 7), row(8192, 1, 200, 20), row(8192, 2, 110, 10)]
    saved, vision, growth = bench.cp_targets(rows, "sdpa_varlen", [4096, 8192], 2)
    assert saved["ok"] and saved["value"] == pytest.approx(0.55) and "at L=8192" in saved["line"]
    assert vision["ok"] and vision["value"] == pytest.approx(0.5) and "also L=4096 0.700" in vision["line"]
    assert growth["ok"] and growth["value"] == pytest.approx(110 / 70)
    rows[3]["saved_bytes"] = 130  # 0.65x: a miss
    assert [t["ok"] for t in bench.cp_targets(rows, "sdpa_varlen", [4096, 8192], 2)] == [False, True, True]
    only = bench.cp_targets(rows[:2], "sdpa_varlen", [4096], 2)  # one length: judged there, no growth target
    assert [t["name"] for t in only] == ["cp_saved", "cp_vision"] and not only[0]["ok"]


@pytest.mark.launch
def test_context_parallel_command_splits_saved_bytes_and_vision_work(tmp_path, monkeypatch):
    """``--context-parallel 2`` starts its own 2 gloo ranks: per rank about half the saved bytes and exactly half
    the vision FLOPs of CP = 1 on the same row (4 images of the same size: 2 per rank). The command's ``main``, in
    this process; the ranks it spawns (``torch.multiprocessing.spawn``, CP = 1 then CP = 2) run on the session's
    pooled ranks (``spawn_on_pool``): bytes and FLOPs are counted inside each rank's forward, whichever process
    started it, and 3 fresh interpreters cost ~15 s of imports."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn_on_pool)
    path = tmp_path / "bench.json"
    bench.main(["--lengths", "1024", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2",
                "--kv-heads", "2", "--segment-median", "1024", "--repeats", "1", "--backends", "sdpa_varlen",
                "--context-parallel", "2", "--json", str(path)])
    result = json.loads(path.read_text())
    one, two = result["rows"]
    assert (one["cp"], two["cp"]) == (1, 2) and len(two["ranks"]) == 2
    assert two["vision_flops"] == one["vision_flops"] / 2
    assert [t["ok"] for t in result["targets"]] == [True, True], result["lines"]


def test_gemma_rows_alternate_sliding_and_full_layers_and_carry_blocks():
    """``--recipe gemma4``: the model's layers alternate sliding / full ending full, with the window asked for, and
    every 256 tokens of a segment hold a 64-token block in its token types (the per-span masks' reason to exist)."""
    args = bench.parse_args(["--recipe", "gemma4", "--lengths", "1024", "--hidden", "64", "--intermediate", "128",
                             "--layers", "3", "--heads", "2", "--kv-heads", "1", "--sliding-window", "128"])
    text = bench.model_config(args)["config"]["text_config"]
    assert text["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert text["sliding_window"] == 128 and text["head_dim"] == 32
    config = bench.load_recipe("gemma4").build_model(bench.model_config(args), "sdpa").config
    sample, = bench.make_samples([600], config, 0, "mm_token_type_ids")
    types = sample.token_fields["mm_token_type_ids"]
    assert int(types.sum()) == 3 * 64 and types[16:80].all() and not types[80:272].any()
    assert not torch.isin(sample.input_ids, torch.tensor([config.image_token_id, config.boi_token_id])).any()


@pytest.mark.parametrize("peak_32k, ok", [(4.0, True), (4.6, False)])
def test_long_growth_target_is_32k_over_8k(peak_32k, ok):
    rows = rows_of({8192: 1.0, 32768: peak_32k}, {8192: 1.0, 32768: 1.0})
    target = bench.target_long_growth(rows, {}, "sdpa_varlen")
    assert target["ok"] is ok and target["line"].endswith("OK" if ok else "MISS")
    missing = bench.target_long_growth(rows[:1], {}, "sdpa_varlen")
    assert not missing["ok"] and "not measured" in missing["line"]
