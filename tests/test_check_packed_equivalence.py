"""``tools/check_packed_equivalence.py``: passes on a correct recipe, exits 1 on a broken ``prepare_packed``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from mvp_engine.engine.testing import load_recipe
from mvp_engine.packing import attention_mask_for
from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_packed_equivalence.py"


def _tool():
    spec = importlib.util.spec_from_file_location("check_packed_equivalence", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_prints_every_segment_and_passes(capsys):
    """The command's ``main`` with its arguments, in this process (a fresh interpreter for it cost ~7 s of
    imports): exit code 0 and a line per segment."""
    code = _tool().main(["--recipe", "qwen2_vl", "--attention", "eager"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("qwen2_vl / eager (float32")
    segments = 5 + bool(Qwen2VLSampleEncoder.video_token)  # equivalence_case adds a video sample where one is taken
    assert sum("max |packed - one-by-one| logit diff" in line for line in lines) == segments
    assert any(line.strip().startswith("loss packed") for line in lines)
    assert any("max relative grad diff" in line for line in lines) and lines[-1].strip() == "OK"


def test_a_broken_prepare_packed_fails_with_exit_code_1(capsys):
    """A plain causal mask over each whole row (the classic packing bug) lets samples see each other."""
    real = load_recipe("llava").prepare_packed

    def causal_across_samples(batch, model, attn_implementation):
        kwargs = real(batch, model, attn_implementation)
        one_segment = torch.zeros_like(batch["pack_segment_ids"])
        kwargs["attention_mask"] = attention_mask_for(one_segment, attn_implementation, model.dtype)
        return kwargs

    assert _tool().main(["--recipe", "llava", "--attention", "sdpa"], prepare_packed=causal_across_samples) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "max logit diff" in out


def test_a_backend_this_machine_cannot_run_exits_2(capsys):
    """Also on a CUDA machine: a test not marked ``gpu`` runs as on the CPU (conftest, ``VLM_PACKING_DEVICE=cpu``),
    and the tool asks the engine's device choice, not whether CUDA exists."""
    assert _tool().main(["--recipe", "llava", "--attention", "flash_attention_2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_withheld_linear_attention_boundaries_fail_with_exit_code_1(capsys):
    """A hybrid model (Qwen3.5) without its linear-attention boundaries: the report shows the leak."""
    assert _tool().main(["--recipe", "qwen3_5", "--attention", "sdpa", "--withhold-linear-boundaries"]) == 1
    lines = capsys.readouterr().out.splitlines()
    worst = next(float(line.split()[-1]) for line in lines if line.startswith("  max logit diff"))
    assert lines[-1].strip().startswith("FAILED") and worst > 1e-2
