"""The Qwen families' hybrid language models (Gated DeltaNet linear attention interleaved with full attention:
Qwen3.5 and Qwen3.5-MoE in transformers 5.24): built like any Qwen model (:func:`recipes.qwen.build_qwen_model`),
their linear-attention layers then made to take packed-sample boundaries
(``mvp_engine.packing.enable_linear_attention_packing``; transformers 5.24 lets their conv window and recurrent
state run from one packed sample into the next), and, for a tiny init, decay rates that make a leak show."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from mvp_engine.engine.builders import to_plain
from mvp_engine.packing import enable_linear_attention_packing
from mvp_engine.packing.linear_attention import linear_attention_layers

from .model import build_qwen_model


def build_hybrid_model(model_cls, config_cls, layer_classes: Collection[type], model_cfg: Mapping | None,
                       attn_implementation: str, tokenizer_dir: Path):
    """``model_cls`` (config ``config_cls``) with its ``layer_classes`` linear-attention layers made boundary-aware:
    ``from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init. Keys read: those of
    ``build_qwen_model`` and, for the tiny init only, ``linear_decay_init``: the range the Gated DeltaNet decay
    rates ``A = exp(A_log)`` are drawn from. transformers draws them from [0.01, 16]: most heads then forget within
    a token or two (decay ``exp(-A * softplus(a + dt_bias))``, about e^-13 per token at A = 10), so a state leak
    between packed samples barely shows (1.5e-4 in logits) and the A_log / dt_bias gradients (1e-5 in norm) sit at
    fp32 rounding (5e-5 relative, measured on the tiny Qwen3.5): too weak an instrument for the packed ==
    one-by-one proof. The tiny configs draw from [0.01, 0.1], a state that carries across their samples."""
    model = build_qwen_model(model_cls, config_cls, model_cfg, attn_implementation, tokenizer_dir,
                             vision_out="out_hidden_size")
    cfg = to_plain(model_cfg) or {}
    if not cfg.get("pretrained") and cfg.get("linear_decay_init"):
        low, high = cfg["linear_decay_init"]
        generator = torch.Generator().manual_seed(int(cfg.get("seed") or 0))
        with torch.no_grad():
            for layer in linear_attention_layers(model, layer_classes):
                layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(low, high, generator=generator).log())
    return enable_linear_attention_packing(model, layer_classes)
