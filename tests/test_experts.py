"""``model.experts_implementation`` (``mvp_engine.engine.experts``): how a MoE recipe's experts compute, refused in one
line naming the key where that cannot run here, before any step.

Why: transformers falls back silently or fails deep in a kernel: ``deepgemm`` / ``sonicmoe`` need CUDA packages;
torch 2.13's CPU ``grouped_mm`` refuses bf16 rows that are not 16-byte aligned at the first forward (shown below);
a dense model has no experts to switch. On the tiny Qwen3.5-MoE (hidden 64, expert width 32: aligned in bf16 too).
"""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.experts import check_experts_implementation
from mvp_engine.engine.testkit import compose_config, load_recipe

RECIPE = "qwen3_5_moe"


def build(*overrides: str):
    return load_recipe(RECIPE).build_model(compose_config(RECIPE, list(overrides)).model, "sdpa")


@pytest.fixture(scope="module")
def model():
    return build()


def test_each_implementation_that_cannot_run_is_one_line_naming_the_key(model):
    cases = {"deepgemm": "'deepgemm' cannot run here: DeepGEMM's CUDA kernels need a CUDA device",
             "sonicmoe": "'sonicmoe' cannot run here: SonicMoE's CUDA kernels need a CUDA device",
             "fused": "'fused' is invalid: allowed eager, "}
    for name, message in cases.items():
        with pytest.raises(ConfigError, match=f"^model.experts_implementation={message}") as err:
            check_experts_implementation(model, name, cuda=False)
        assert "\n" not in str(err.value)
    dense = load_recipe("qwen3_5").build_model(compose_config("qwen3_5").model, "sdpa")
    with pytest.raises(ConfigError, match="'grouped_mm' is invalid: Qwen3_5ForConditionalGeneration has no experts"):
        check_experts_implementation(dense, "grouped_mm")


def test_grouped_mm_on_unaligned_bf16_rows_is_refused_before_torch_fails_on_it():
    """An expert width of 12 in bf16 (24-byte rows): the recipe's build stops in one line; torch's kernel itself
    would fail at the first forward."""
    with pytest.raises(ConfigError, match=r"'grouped_mm' cannot run on model\.language_model\.layers\.0\.mlp\.experts"
                                          r"\.down_proj \(4, 64, 12\) in torch\.bfloat16: its rows are not 16-byte"):
        build("model.dtype=bfloat16", "model.config.text_config.moe_intermediate_size=12")
    tokens, weights = torch.ones(6, 12, dtype=torch.bfloat16), torch.ones(2, 12, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.nn.functional.grouped_mm(tokens, weights, offs=torch.tensor([3, 6], dtype=torch.int32))


def test_the_configured_implementation_is_what_the_experts_run(model):
    """grouped_mm (the tiny config's), then eager and batched_mm by the key: transformers' experts read it."""
    assert model.config.get_text_config()._experts_implementation == "grouped_mm"
    for name in ("eager", "batched_mm"):
        assert build(f"model.experts_implementation={name}").config.get_text_config()._experts_implementation == name
    check_experts_implementation(build("model.dtype=bfloat16"), "grouped_mm")  # aligned in bf16: accepted
