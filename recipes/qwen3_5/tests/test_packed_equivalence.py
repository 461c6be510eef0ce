"""Packed Qwen3.5 forwards equal one-by-one forwards through both layer kinds (the kit's ``EquivalenceSuite``: logits,
loss and gradients on packs of text-only, image and video samples, per backend; and its negative check: with the
linear-attention boundaries withheld the kit reports a difference over 1e-2), plus what is Qwen3.5's own: the guard
refuses a forward that would leak before a step, transformers' own linear-attention functions leak or refuse (the
trap is real), and the padded baseline.

Everything runs on the tiny random model (``conf/model/qwen3_5_tiny.yaml``) in fp32 on CPU; the gpu-marked test runs
the per-sample linear-attention path on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

import mvp_engine.engine.testing as kit
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.testkit.suites import EquivalenceSuite
from mvp_engine.engine.trainer import Trainer
from mvp_engine.packing import ensure_linear_attention_boundaries
from mvp_engine.packing.linear_attention import _MARK, BOUNDARIES, CHUNK_RULE, CONV
from recipes.qwen3_5.packed import prepare_packed, prepare_padded

TOL = 1e-5


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "qwen3_5"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return kit.equivalence_case("qwen3_5", tmp_path_factory.mktemp("qwen3_5_case"))


@pytest.fixture(scope="module")
def model(case):
    return case.recipe.build_model(case.model_cfg, "sdpa").eval()


def restore_transformers_functions(monkeypatch) -> None:
    """transformers' own conv1d and gated delta rule back in place (the wrappers return after the test)."""
    for name in (CONV, CHUNK_RULE):
        current = getattr(modeling, name)
        monkeypatch.setattr(modeling, name, current.__wrapped__ if getattr(current, _MARK, False) else current)


def test_guard_refuses_linear_layers_that_ignore_boundaries(case, model, monkeypatch):
    restore_transformers_functions(monkeypatch)
    with pytest.raises(ValueError, match="enable_linear_attention_packing"):
        prepare_packed(case.batch, model, "sdpa")


def test_training_stops_before_its_first_step(tmp_path, monkeypatch):
    """The trainer calls ``prepare_packed`` on every micro-batch before the forward: the guard stops the run before
    any optimizer step when the linear layers would ignore the boundaries."""
    cfg = kit.compose_config("qwen3_5", ["+packing=greedy", "demo.num_samples=8", "demo.videos=false",
                                         f"demo.out_dir={tmp_path / 'demo'}", f"train.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(with_demo_data(cfg), kit.load_recipe("qwen3_5"))
    restore_transformers_functions(monkeypatch)
    with pytest.raises(ValueError, match="enable_linear_attention_packing"):
        trainer.run()
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


def test_guard_refuses_a_packed_forward_without_boundaries(case, model):
    kwargs = prepare_packed(case.batch, model, "sdpa")
    assert kwargs["attention_mask"].dim() == 4  # both kinds of boundaries in one call
    assert torch.equal(kwargs[BOUNDARIES], case.batch["cu_seqlens"].to(torch.int32))
    with pytest.raises(ValueError, match=f"needs {BOUNDARIES}"):
        ensure_linear_attention_boundaries(model, {k: v for k, v in kwargs.items() if k != BOUNDARIES})


def test_transformers_alone_leaks_silently_or_refuses(case, model, monkeypatch):
    """The trap, measured on transformers 5.24's own functions: with the mask right for the full-attention layers
    and no boundaries the linear layers run across samples silently; given boundaries the torch fallback refuses."""
    kwargs = prepare_packed(case.batch, model, "sdpa")
    with torch.no_grad():
        exact = model(**kwargs).logits
        restore_transformers_functions(monkeypatch)
        leaky = model(**{k: v for k, v in kwargs.items() if k != BOUNDARIES}).logits
        assert (leaky - exact).abs().max().item() > kit.LEAK_FLOOR
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            model(**kwargs)


def test_padded_baseline_equals_one_by_one(case, model):
    """Unpacked rows with right padding: the linear layers zero the padding (2-D mask), which comes after."""
    rows = [[case.samples[2]], [case.samples[1]], [case.samples[0]]]
    batch = kit.collate_rows(rows, case.pad_token_id)
    with torch.no_grad():
        logits = model(**prepare_padded(batch, model, "sdpa")).logits
        for b, (sample,) in enumerate(rows):
            alone = model(**prepare_padded(case.alone(sample), model, "sdpa")).logits[0]
            assert (logits[b, : sample.length] - alone).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_varlen"])
def test_linear_attention_packing_on_cuda(case, backend):
    """The packed linear-attention path on CUDA (fp32). Without flash-linear-attention both sides run the torch
    reference (packed: per sample); with it both run fla's gated delta rule (packed: its varlen kernel over the
    flattened batch, ``linear_attention.fla_varlen``; one by one: transformers' own call per row). The conv runs the
    torch reference packed and causal-conv1d's kernel, if installed, one by one."""
    report = kit.run_equivalence(case, backend, device="cuda", dtype=torch.float32, tol=TOL)
    print("\n".join(report.lines()))
    report.check()
