"""sdpa_varlen: per-span causal sdpa equals the dense block-causal mask, and rejects what it cannot honour."""

import types

import pytest
import torch
import torch.nn.functional as F

from mvp_engine.packing import block_causal_mask, flash_varlen_kwargs
from mvp_engine.packing.varlen_sdpa import sdpa_varlen_attention

CAUSAL = types.SimpleNamespace(is_causal=True)


def qkv(batch=2, heads=4, kv_heads=2, length=12, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim))
    return tuple(torch.randn(*shape, generator=gen) for shape in shapes)


def segments():
    return torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])


def test_varlen_equals_dense_block_causal_mask():
    q, k, v = qkv()
    seg = segments()
    out, _ = sdpa_varlen_attention(CAUSAL, q, k, v, None, **flash_varlen_kwargs(seg))
    mask = block_causal_mask(seg)  # bool (B, 1, L, L), padding attends only padding
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    assert out.shape == (2, 12, 4, 8)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)


def test_padding_mask_path_equals_per_row_causal_attention():
    q, k, v = qkv(seed=1)
    padding = torch.tensor([[1] * 9 + [0] * 3, [1] * 12])
    out, _ = sdpa_varlen_attention(CAUSAL, q, k, v, padding)
    for row, n in ((0, 9), (1, 12)):
        alone = F.scaled_dot_product_attention(q[row:row + 1, :, :n], k[row:row + 1, :, :n].repeat_interleave(2, 1),
                                               v[row:row + 1, :, :n].repeat_interleave(2, 1), is_causal=True)
        assert torch.allclose(out[row, :n], alone[0].transpose(0, 1), atol=1e-6)


def test_refuses_left_padding_and_partial_spans():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="needs right padding"):
        sdpa_varlen_attention(CAUSAL, q, k, v, torch.tensor([[0] * 3 + [1] * 9, [1] * 12]))
    with pytest.raises(ValueError, match="must cover all 24 tokens"):
        sdpa_varlen_attention(CAUSAL, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="takes cu_seq_lens_q/k or a 2-D padding mask"):
        sdpa_varlen_attention(CAUSAL, q, k, v, torch.ones(2, 1, 12, 12, dtype=torch.bool))
