"""``model.quantization``: QLoRA, the frozen base of the layers LoRA adapts stored in 4-bit NF4 or 8-bit
(bitsandbytes), the adapters trained on top in the model's dtype.

Why: a 7B-72B base in bf16 is 2 bytes a parameter on every rank; NF4 is about half a byte (two codes a byte plus
an fp32 absmax per 64 weights), int8 one byte plus a scale per row. The adapters, their gradients and optimizer
state are small, so the base's bytes decide what fits (``tools/plan_memory.py``).

Which layers: exactly the linear layers the adapters wrap (``model.lora.target_modules``,
``lora.target_linear_layers``): they are frozen under LoRA, and peft wraps a bitsandbytes layer with its own LoRA
layer; embeddings, the output head, norms and layers LoRA does not adapt keep the model's dtype. Each layer's
weights are quantized from the model as built (a seeded init or the pretrained weights), so no other loading path
is needed.

bitsandbytes is an optional extra (``pip install -e '.[qlora]'``); its import is here and lazy. Its 4-bit and 8-bit
paths run on the CPU too (0.50: a torch fallback), which the tests use.
"""

from __future__ import annotations

import torch

from .config import ConfigError, ModelSpec
from .lora import target_linear_layers

INSTALL = "pip install -e '.[qlora]'"
# FSDP2 would shard the packed codes, and its ranks other than 0 build no weights to quantize
FSDP2_REFUSAL = "model.quantization with train.sharding=fsdp2 is not supported: use train.sharding=none (DDP) for QLoRA"


def _bitsandbytes(quantization: str):
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"model.quantization={quantization} needs bitsandbytes, an optional extra: {INSTALL}") \
            from None
    return bitsandbytes


def _quantized(linear: torch.nn.Linear, quantization: str, bnb) -> torch.nn.Module:
    """A bitsandbytes layer holding ``linear``'s weights quantized (on ``linear``'s device), frozen, computing in
    ``linear``'s dtype."""
    weight, bias = linear.weight.detach(), linear.bias
    if quantization == "nf4":
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias is not None,
                                  compute_dtype=weight.dtype, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(weight.to("cpu"), requires_grad=False, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias is not None,
                                    has_fp16_weights=False, device="meta")
        layer.weight = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().to("cpu"), requires_grad=False)
    return layer.to(weight.device)  # bitsandbytes quantizes as the weight moves to its device


def quantize_base(model: torch.nn.Module, spec: ModelSpec) -> list[str]:
    """Replace the linear layers ``spec.lora`` will adapt by ``spec.quantization`` layers, in place (before the
    adapters are added); returns their names. A model without weights (the ranks FSDP2 hands rank 0's weights)
    is refused: :data:`FSDP2_REFUSAL`, as ``parallel.parallelize`` refuses rank 0's quantized model."""
    if spec.quantization == "none":
        return []
    bnb = _bitsandbytes(spec.quantization)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(FSDP2_REFUSAL)
    names = target_linear_layers(model, spec.lora.target_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized(getattr(parent, child), spec.quantization, bnb))
    return names


def quantized_layers(model: torch.nn.Module) -> int:
    """How many bitsandbytes layers ``model`` holds (for the start line and tests); 0 without bitsandbytes."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    return sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules())
