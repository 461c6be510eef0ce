"""``model.quantization`` (QLoRA): the base of the layers LoRA adapts in NF4 / int8 (bitsandbytes), adapters on top.

Always checked: the config refuses a quantized base without adapters and an unknown scheme, and a run asking for
it without bitsandbytes installed stops with one line naming the extra. With bitsandbytes (the optional ``qlora``
extra, which the dev extra installs; 0.50 runs its 4-bit and 8-bit layers on the CPU through a torch fallback): the
adapted layers are 4-bit, and a packed micro-batch of the Qwen2.5-VL case computes what its samples one by one
compute (logits, loss, the adapters' gradients) on the 4-bit base.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, LoraSpec, ModelSpec, TrainSpec
from mvp_engine.engine.parallel import parallelize
from mvp_engine.engine.quantize import quantize_base, quantized_layers
from mvp_engine.engine.testkit.suites import shared_case
from mvp_engine.packing import SDPA_VARLEN

RECIPE = "qwen2_5_vl"


def test_a_quantized_base_without_adapters_or_with_an_unknown_scheme_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"^model.quantization=nf4 freezes a quantized base: train LoRA adapters "
                                          r"on it \(model.lora.r > 0\)$"):
        ModelSpec(quantization="nf4")
    with pytest.raises(ConfigError, match=r"^model.quantization='fp4' is invalid: allowed one of "):
        ModelSpec(quantization="fp4", lora=LoraSpec(r=4))


def test_without_bitsandbytes_the_run_stops_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    spec = ModelSpec(quantization="nf4", lora=LoraSpec(r=4))
    with pytest.raises(ConfigError, match=r"^model.quantization=nf4 needs bitsandbytes, an optional extra: "
                                          r"pip install -e '.\[qlora\]'$"):
        quantize_base(torch.nn.Linear(4, 4), spec)


@pytest.fixture(scope="module")
def bitsandbytes():
    """The dev extra installs the qlora extra, so a missing bitsandbytes fails here rather than skipping."""
    import bitsandbytes

    return bitsandbytes


def test_packed_equals_one_by_one_on_a_4bit_base(bitsandbytes, tmp_path_factory):
    case = shared_case(RECIPE, tmp_path_factory)
    lora = LoraSpec(r=4)
    model = case.recipe.build_model(case.model_cfg, SDPA_VARLEN)
    names = quantize_base(model, ModelSpec(quantization="nf4", lora=lora))
    assert names and quantized_layers(model) == len(names)
    assert all(model.get_submodule(name).weight.dtype == torch.uint8 for name in names)  # packed 4-bit codes
    report = kit.run_equivalence(case, SDPA_VARLEN, lora=lora, quantization="nf4")
    print("\n".join(report.lines()))
    report.check()


def test_a_quantized_base_is_refused_under_fsdp2_on_every_rank(bitsandbytes):
    """Rank 0 quantizes and is refused by ``parallelize``; the ranks that build no weights are refused before."""
    spec = ModelSpec(quantization="nf4", lora=LoraSpec(r=4, target_modules=["0"]))
    with torch.device("meta"), pytest.raises(ConfigError, match=r"^model.quantization with train.sharding=fsdp2 "):
        quantize_base(torch.nn.Sequential(torch.nn.Linear(4, 4)), spec)
    built = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantize_base(built, spec)
    with pytest.raises(ConfigError, match=r"^model.quantization with train.sharding=fsdp2 is not supported"):
        parallelize(built, SimpleNamespace(shard=None), TrainSpec(sharding="fsdp2"), accelerator=object())


def test_adapters_trained_on_a_4bit_base_save_against_the_unquantized_base(bitsandbytes, tmp_path_factory, tmp_path):
    """The final save rebuilds the base unquantized and takes from the run's state dict what trained (the adapters),
    not the packed 4-bit codes: the adapter folder holds the run's adapter weights."""
    from safetensors.torch import load_file

    from mvp_engine.engine.lora import add_adapters, save_adapters

    case = shared_case(RECIPE, tmp_path_factory)
    lora = LoraSpec(r=4)
    model = case.recipe.build_model(case.model_cfg, SDPA_VARLEN)
    quantize_base(model, ModelSpec(quantization="nf4", lora=lora))
    model = add_adapters(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.25)
    state = model.state_dict()
    save_adapters(lambda: case.recipe.build_model(case.model_cfg, SDPA_VARLEN), lora, state, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    lora_b = [value for key, value in saved.items() if ".lora_B." in key]
    assert lora_b and all(bool((value == 0.25).all()) for value in lora_b)
