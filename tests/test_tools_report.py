"""The numbers of ``tools/pack_report.py`` and ``tools/estimate_steps.py`` (``mvp_engine.engine.plan_report``) on
the demo data.

Why: a report is only useful if its numbers are the run's numbers. These tests check that the CLI writes the
computed numbers, that the report reconciles with a plan built independently through the kit, and that the step
estimate equals ``Trainer.total_steps`` and the steps a real short run takes (whose token accounting must also equal
the report's padding and attention numbers).
"""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest

from mvp_engine.engine.config import ConfigError, DemoSpec, resolve_run_specs
from mvp_engine.engine.demo import JSONL_NAME, with_demo_data, write_demo_dataset
from mvp_engine.engine.demo import demo_dir as demo_folder
from mvp_engine.engine.plan_report import compute_pack_report, compute_step_estimate
from mvp_engine.engine.report_config import ReportSpec, report_spec, resolve_world_size
from mvp_engine.engine.testing import compose_config, load_recipe, packing_overrides
from mvp_engine.engine.trainer import Trainer
from mvp_engine.kit.mllm.data import MLLMDataKit
from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pack_report.py"
RECIPE_NAME = "qwen2_vl"
DEMO_SAMPLES = 60
MAX_SEQ_LEN = 512


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """One demo data set for the whole module (written once; every config points at it)."""
    out = tmp_path_factory.mktemp("demo")
    write_demo_dataset(demo_folder(DemoSpec(out_dir=str(out), num_samples=DEMO_SAMPLES)), DEMO_SAMPLES, 0)
    return out


def overrides(demo_dir: Path, packing: str | None, *extra: str) -> list[str]:
    return [*packing_overrides(packing), f"demo.num_samples={DEMO_SAMPLES}", f"demo.out_dir={demo_dir}",
            f"data.max_seq_len={MAX_SEQ_LEN}", *extra]


def composed(args: list[str]):
    """The config a training command with ``args`` trains on (its entry point fills the demo sources)."""
    return with_demo_data(compose_config(RECIPE_NAME, args))


def reference_dataset(cfg, rank: int = 0, world_size: int = 1):
    """The dataset built straight through the kit, not through the tools' helpers."""
    recipe = load_recipe(RECIPE_NAME)
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    specs.data.sources = [str(demo_folder(specs.demo) / JSONL_NAME)]
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    return MLLMDataKit.build_dataset(specs.data, encoder, rank=rank, world_size=world_size,
                                     drop_last=specs.train.drop_last), specs.train


# --- the command line ---------------------------------------------------------------------------------------


def test_pack_report_cli_writes_json_and_png_of_the_computed_numbers(demo_dir, tmp_path, monkeypatch, capsys):
    """``tools/pack_report.py`` run as its command runs it (``__main__``, the arguments on ``sys.argv``), in this
    process: a fresh interpreter for it cost ~8 s of imports (``tools/check_data.py``'s tests start a Hydra tool as
    a plain script, and no tool edits its import path: ``tests/test_layering.py``). It writes exactly what
    ``compute_pack_report`` computes and says where."""
    args = overrides(demo_dir, "greedy", f"+report.out_dir={tmp_path / 'report'}")
    monkeypatch.setattr(sys, "argv", ["tools/pack_report.py", *args, f"hydra.run.dir={tmp_path / 'run'}"])
    runpy.run_path(str(TOOL), run_name="__main__")  # a failed run exits (SystemExit), as the command does
    out = capsys.readouterr().out
    report_dir = tmp_path / "report"
    assert out.splitlines()[-1] == f"wrote {report_dir / 'report.json'} and {report_dir / 'pack_report.png'}", out
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (tmp_path / "report" / "pack_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written == json.loads(json.dumps(compute_pack_report(composed(args))))


# --- the numbers reconcile -----------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [None, "greedy", "bfd"])
def test_report_numbers_reconcile_with_the_plan(demo_dir, packing):
    cfg = composed(overrides(demo_dir, packing, "train.micro_batch_size=3"))
    report = compute_pack_report(cfg)
    dataset, train = reference_dataset(cfg)
    plan = dataset.plan(0)
    assert report["records"] == DEMO_SAMPLES == report["admitted_samples"] + report["dropped_total"]
    assert report["dropped"] == dict(plan.drop_counts) and report["dropped_total"] > 0  # the demo has overlong ones
    assert report["packs"] == len(plan.packs)
    assert report["packs"] * report["samples_per_pack"]["mean"] == pytest.approx(report["admitted_samples"])
    assert report["admitted_tokens"] == sum(plan.lengths[i] for pack in plan.packs for i in pack)
    assert report["lower_bound_packs"] == math.ceil(report["admitted_tokens"] / MAX_SEQ_LEN)
    assert report["packs"] >= report["lower_bound_packs"]
    assert report["mean_fill"] == pytest.approx(report["admitted_tokens"] / (report["packs"] * MAX_SEQ_LEN))
    for name, hist in report["histograms"].items():
        assert sum(hist["counts"]) == report["packs"], name
        assert len(hist["edges"]) == len(hist["counts"]) + 1, name
    batching = report["batching"]
    assert batching["rows"] == report["packs"] and batching["effective_tokens"] == report["admitted_tokens"]
    assert batching["micro_batches"] == math.ceil(report["packs"] / 3) == batching["micro_batches_per_rank"]
    assert 0 <= batching["padding_ratio"] < 1 and 0 < batching["attention_work_ratio"] <= 1
    assert report["estimated_optimizer_steps"] == dataset.estimate_total_steps(
        train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    if packing is None:
        assert report["packs"] == report["admitted_samples"] and report["samples_per_pack"]["max"] == 1
    else:
        assert report["samples_per_pack"]["mean"] > 1


def test_report_shows_cost_and_the_imbalance_before_and_after_balancing(demo_dir):
    """``+packing=bfd packing.balance=compute``: the plan served is the balanced one, the costs add up, and the
    imbalance at simulated ranks (one pack per rank per step: only grouping packs into steps can help) falls."""
    cfg = composed(overrides(demo_dir, "bfd", "packing.balance=compute", "train.micro_batch_size=1",
                             "+report.world_size=2", "+report.balance_ranks=3"))
    report = compute_pack_report(cfg)
    cost = report["cost"]
    assert cost["balance"]["configured"] == "compute" and cost["balance"]["none"]["world_size"] == 3
    assert sum(cost["per_rank"]["values"]) == pytest.approx(cost["per_pack"]["total"])
    assert cost["per_pack"]["total"] == pytest.approx(report["packs"] * cost["per_pack"]["mean"])
    none, balanced = cost["balance"]["none"], cost["balance"]["compute"]
    assert none["full_steps"] == balanced["full_steps"] == report["packs"] // 3 > 1
    assert balanced["mean"] < none["mean"] and balanced["p95"] <= none["p95"]
    plain = compose_config(RECIPE_NAME, overrides(demo_dir, "bfd", "train.micro_batch_size=1"))
    assert report["packs"] == len(reference_dataset(plain, world_size=2)[0].plan(0).packs)


def test_tools_never_encode_a_sample(demo_dir, monkeypatch):
    """Planning reads lengths and image headers only: encoding (which decodes images) must never run."""
    def refuse(*args, **kwargs):
        raise AssertionError("a report tool encoded a sample")

    monkeypatch.setattr(Qwen2VLSampleEncoder, "encode", refuse)
    monkeypatch.setattr(Qwen2VLSampleEncoder, "_load_image", refuse)
    cfg = composed(overrides(demo_dir, "greedy"))
    assert compute_pack_report(cfg)["packs"] > 0
    assert compute_step_estimate(cfg)["total_optimizer_steps"] > 0


def test_world_size_splits_packs_like_the_ranks_do(demo_dir):
    cfg = composed(overrides(demo_dir, "greedy", "train.micro_batch_size=2", "+report.world_size=3"))
    report = compute_pack_report(cfg)
    estimate = compute_step_estimate(cfg)
    ranks = [reference_dataset(cfg, rank=r, world_size=3)[0] for r in range(3)]
    batching = report["batching"]
    assert batching["world_size"] == estimate["world_size"] == 3
    assert batching["rows"] == sum(len(ds) for ds in ranks) == 3 * estimate["per_epoch"][0]["packs_per_rank"]
    assert batching["all_padding_rows"] == batching["rows"] - report["packs"]
    assert batching["micro_batches"] == 3 * estimate["per_epoch"][0]["micro_batches_per_rank"]
    epochs = report["steps"]["epochs"]
    assert estimate["total_optimizer_steps"] == report["estimated_optimizer_steps"] == ranks[0].estimate_total_steps(
        epochs, 2, 1)


def test_world_size_comes_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_world_size(ReportSpec()) == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_world_size(ReportSpec()) == 4
    assert resolve_world_size(ReportSpec(world_size=2)) == 2
    monkeypatch.setenv("WORLD_SIZE", "zero")
    with pytest.raises(ConfigError, match="WORLD_SIZE='zero' is invalid"):
        resolve_world_size(ReportSpec())


def test_report_config_defaults_and_errors():
    assert report_spec(compose_config(RECIPE_NAME)) == ReportSpec()  # no report.* given: ReportSpec's defaults
    with pytest.raises(ConfigError, match=r"report.bins=0 is invalid"):
        report_spec(compose_config(RECIPE_NAME, ["+report.bins=0"]))
    with pytest.raises(ConfigError, match=r"^report: .*nope"):
        report_spec(compose_config(RECIPE_NAME, ["+report.nope=1"]))
    assert report_spec(compose_config(RECIPE_NAME, ["+report=default", "report.epoch=2"])).epoch == 2


# --- the estimate is the run's ------------------------------------------------------------------------------


@pytest.mark.parametrize(("packing", "extra"), [
    ("greedy", ("train.micro_batch_size=2", "train.gradient_accumulation_steps=3")),
    ("bfd", ("packing.buffer_size=16", "train.micro_batch_size=3", "train.drop_last=true")),  # streaming bfd
    (None, ("train.micro_batch_size=5", "train.gradient_accumulation_steps=2", "train.drop_last=true",
            "train.epochs=2")),
])
def test_estimate_equals_the_trainers_total_steps(demo_dir, tmp_path, packing, extra):
    args = overrides(demo_dir, packing, *extra)
    estimate = compute_step_estimate(composed(args))
    trainer = Trainer(composed([*args, f"train.output_dir={tmp_path}"]), load_recipe(RECIPE_NAME))
    assert estimate["total_optimizer_steps"] == trainer.total_steps
    assert estimate["total_optimizer_steps"] == sum(e["optimizer_steps"] for e in estimate["per_epoch"])


@pytest.mark.slow
def test_estimate_and_report_equal_a_real_run(demo_dir, tmp_path):
    """One short real training: its step count and token accounting are the tools' numbers."""
    args = overrides(demo_dir, "greedy", "train.epochs=1", "train.micro_batch_size=2",
                     "train.gradient_accumulation_steps=3", "train.log_every=1000")
    report = compute_pack_report(composed(args))
    estimate = compute_step_estimate(composed(args))
    trainer = Trainer(composed([*args, f"train.output_dir={tmp_path}"]), load_recipe(RECIPE_NAME))
    summary = trainer.run()
    assert summary["actual_steps"] == trainer.total_steps == estimate["total_optimizer_steps"]
    assert summary["actual_steps"] == report["estimated_optimizer_steps"]
    totals, batching = summary["totals"], report["batching"]
    assert totals["samples"] == report["admitted_samples"] and totals["packs"] == report["packs"]
    assert totals["dropped"] == report["dropped"]
    assert totals["batches"] == batching["micro_batches"]
    for run_key, report_key in (("slots", "slots"), ("effective", "effective_tokens"),
                                ("attention_work", "attention_work"), ("dense_attention_work", "dense_attention_work")):
        assert totals[run_key] == batching[report_key], run_key
    assert totals["padding_ratio"] == pytest.approx(batching["padding_ratio"])
    # the useful FLOPs the run counted from its batches are the planner's per-pack costs (metadata only)
    assert totals["model_flops"] == pytest.approx(report["cost"]["per_pack"]["total"], rel=1e-12)
    assert totals["executed_flops"] >= totals["model_flops"] and summary["flops"]["tflops_per_s"] > 0
