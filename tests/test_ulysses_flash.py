"""Context parallelism on flash attention: the Ulysses wrapper reaches flash-attn's kernels.

transformers' flash forward looks its kernels up by ``module.config._attn_implementation``; under Ulysses that names
``ulysses_flash_attention_2``, which transformers used to refuse at the first layer. The check runs on the CPU with
a stand-in flash-attn package (transformers imports it by name) that computes plain causal attention per segment.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import PretrainedConfig
from transformers import modeling_flash_attention_utils as flash_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mvp_engine.packing import SequenceShard, sequence_sharded
from mvp_engine.packing.ulysses import PREFIX

# the kernels transformers keeps once loaded: put back after the test, so no later test meets the stand-in
LOADED = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn",
          "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False):
    """flash-attn's ``flash_attn_varlen_func`` on (tokens, heads, dim), by torch's sdpa per segment."""
    bounds = cu_seqlens_q.tolist()
    out = [torch.nn.functional.scaled_dot_product_attention(
        *(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=causal, scale=softmax_scale).transpose(0, 1)
        for start, end in zip(bounds, bounds[1:])]
    return torch.cat(out)


@pytest.fixture
def stand_in_flash_attn(monkeypatch):
    package = types.ModuleType("flash_attn")
    package.flash_attn_func = package.flash_attn_with_kvcache = None
    package.flash_attn_varlen_func = varlen_attention
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input = padding.unpad_input = None
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda: True)
    for name in LOADED:
        monkeypatch.setattr(flash_utils, name, getattr(flash_utils, name))
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)


class Attention(torch.nn.Module):
    """What transformers hands an attention function: a causal layer whose config names the Ulysses backend, as
    ``enable_ulysses`` leaves the language model's."""

    is_causal = True
    layer_idx = 0

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation_internal = f"{PREFIX}flash_attention_2"
        self.q_proj = torch.nn.Linear(8, 8)


def test_ulysses_runs_flash_attention_under_its_own_name(stand_in_flash_attn):
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, 6, 4) for _ in range(3))  # (B, H, L, D): two segments of 4 and 2
    cu_seqlens = torch.tensor([0, 4, 6], dtype=torch.int32)
    attention = ALL_ATTENTION_FUNCTIONS[f"{PREFIX}flash_attention_2"]
    with sequence_sharded(SequenceShard(group=None, rank=0, size=1)):
        out, _ = attention(Attention(), query, key, value, None, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                           max_length_q=4, max_length_k=4)
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[..., s, :], key[..., s, :], value[..., s, :], is_causal=True) for s in (slice(0, 4), slice(4, 6))], 2)
    torch.testing.assert_close(out, expected.transpose(1, 2))
