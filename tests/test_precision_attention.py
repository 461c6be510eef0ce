"""The run's precision and its attention backend are chosen together: flash attention computes in bf16 / fp16 only.

``train.mixed_precision=auto`` (the default) is bf16 on CUDA and no (fp32) on the CPU; ``attention=auto`` takes
flash_attention_2 only where the run computes in bf16 or fp16, and an explicit flash backend in fp32 is refused in
one line before anything is built. On the CPU the machine is posed as one with CUDA and flash-attn by replacing the
two probes the choice reads.
"""

from __future__ import annotations

import pytest
import torch

import mvp_engine.engine.config as config
import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, choose_attention, resolve_mixed_precision, resolve_run_specs

RECIPE = "qwen2_vl"
BACKENDS = kit.load_recipe(RECIPE).attention_backends


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine with CUDA and the flash_attn package, as the config sees it."""
    monkeypatch.setattr(config, "cuda_in_use", lambda: True)
    monkeypatch.setattr(config, "package_available", lambda package: True)


def specs(*overrides: str):
    return resolve_run_specs(kit.compose_config(RECIPE, ["+packing=greedy", *overrides]), BACKENDS)


def test_auto_precision_is_bf16_on_cuda_and_fp32_on_the_cpu(monkeypatch):
    assert config.TrainSpec.mixed_precision == "auto"
    monkeypatch.setattr(config, "cuda_in_use", lambda: False)
    assert resolve_mixed_precision("auto") == "no"
    monkeypatch.setattr(config, "cuda_in_use", lambda: True)
    assert resolve_mixed_precision("auto") == "bf16"
    assert [resolve_mixed_precision(value) for value in ("no", "bf16")] == ["no", "bf16"]


def test_the_default_run_on_a_gpu_computes_in_bf16_with_flash(gpu_machine):
    run = specs()
    assert (run.train.mixed_precision, run.attention) == ("bf16", "flash_attention_2")
    assert run.attention_why == ("packed run computing in bfloat16, auto: the first of flash_attention_2, "
                                 "sdpa_varlen, sdpa it can train with")


@pytest.mark.parametrize("packed, expected", [(True, "sdpa_varlen"), (False, "sdpa")])
def test_auto_attention_in_fp32_passes_flash_by_and_says_why(gpu_machine, packed, expected):
    name, why = choose_attention("auto", BACKENDS, packed, torch.float32)
    assert name == expected
    assert why.startswith(f"{'packed' if packed else 'unpacked'} run computing in float32, auto: flash_attention_2 "
                          "computes in bf16 or fp16 only")
    assert choose_attention("auto", BACKENDS, packed, torch.bfloat16)[0] == "flash_attention_2"


def test_fp32_weights_under_bf16_autocast_or_bf16_weights_take_flash(gpu_machine):
    assert specs("train.mixed_precision=no").attention == "sdpa_varlen"
    assert specs("train.mixed_precision=no", "model.dtype=bfloat16").attention == "flash_attention_2"


def test_explicit_flash_in_fp32_is_refused_in_one_line_naming_both_keys(gpu_machine):
    with pytest.raises(ConfigError) as refused:
        specs("attention=flash_attention_2", "train.mixed_precision=no")
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("attention.implementation='flash_attention_2' computes in bf16 or fp16 only, and this run "
                           "computes in float32: set train.mixed_precision=bf16"), line


def test_the_cpu_keeps_fp32_and_says_why_flash_is_passed_by(monkeypatch):
    monkeypatch.setattr(config, "cuda_in_use", lambda: False)
    run = specs()
    assert (run.train.mixed_precision, run.attention) == ("no", "sdpa_varlen")
    assert run.attention_why == ("packed run computing in float32, auto: flash_attention_2 needs a CUDA GPU and the "
                                 "flash_attn package")
