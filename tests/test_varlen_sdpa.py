"""sdpa_varlen: per-span causal sdpa equals the dense block-causal mask, rejects what it cannot honour, and hands
each grouped-query call to a kernel that takes it (K/V expanded where CUDA's flash kernel would refuse it); a
preference pair's segment, its continuations merged with its shared prefix, equals the dense pair mask."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from mvp_engine.packing import (
    block_causal_mask,
    causal,
    dense_mask,
    flash_varlen_kwargs,
    sliding_window,
    span_masks,
    varlen_sdpa,
)
from mvp_engine.packing.branches import carry_pair_parts, pair_parts, same_branch_or_prefix
from mvp_engine.packing.prefix_attention import prefix_merged_attention, shared_prefix_obstacle
from mvp_engine.packing.varlen_sdpa import gqa_arguments, sdpa_varlen_attention

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


# (G, H, n, D) spans of 8 query heads over 2 K/V heads; ``CASES``: what each reaches on CUDA
SPAN_MASK = torch.ones(16, 16, dtype=torch.bool).tril().triu(-3)  # a sliding window of 4


def span_qkv(dtype=torch.float32, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, heads, 16, dim, generator=gen).to(dtype) for heads in (8, 2, 2))


CASES = {  # name: (dtype, head_dim, mask, enable_gqa on CUDA)
    "unmasked bf16": (torch.bfloat16, 64, None, True),
    "masked span": (torch.bfloat16, 64, SPAN_MASK, False),
    "fp32": (torch.float32, 64, None, False),
    "head_dim 512": (torch.bfloat16, 512, None, False),
}


@pytest.mark.parametrize("case", CASES)
def test_gqa_arguments_hand_each_call_to_a_kernel_that_takes_it(case):
    """On CUDA only flash takes enable_gqa (no mask, fp16/bf16, head_dim <= 256): everything else gets K/V expanded
    to the query's heads, for the memory-efficient kernel; on CPU the fused kernel takes GQA as it is."""
    dtype, dim, mask, fused_gqa = CASES[case]
    q, k, v = span_qkv(dtype, dim)
    key, value, gqa = gqa_arguments(q, k, v, mask, "cuda")
    assert gqa == fused_gqa
    assert key.shape[1] == value.shape[1] == (2 if fused_gqa else 8)
    if not fused_gqa:  # the group's heads adjacent, as enable_gqa pairs query head h with K/V head h // 4
        assert torch.equal(key[:, 4:8], k[:, 1:2].expand(-1, 4, -1, -1))
    assert gqa_arguments(q, k, v, mask, "cpu") == (k, v, True)
    assert SDPBackend(torch._fused_sdp_choice(q, k, v, mask, enable_gqa=True)) == SDPBackend.FLASH_ATTENTION
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (expanded.float() - grouped.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_gqa_arguments_leave_equal_head_counts_alone():
    q, k, v = span_qkv()
    q = q[:, :2]
    assert gqa_arguments(q, k, v, SPAN_MASK, "cuda") == (k, v, False)


def test_sdpa_varlen_expands_kv_for_masked_spans_on_cuda(monkeypatch):
    """Through the backend, with CUDA's choice: the plain causal spans keep enable_gqa, the windowed span gets K/V
    expanded, and the output is the dense mask's."""
    calls = []
    real_sdpa, real_choice = F.scaled_dot_product_attention, gqa_arguments

    def recording_sdpa(q, k, v, **kwargs):
        calls.append((kwargs["attn_mask"] is not None, k.shape[1], kwargs["enable_gqa"]))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(varlen_sdpa.F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(varlen_sdpa, "gqa_arguments", lambda q, k, v, mask, _: real_choice(q, k, v, mask, "cuda"))
    segment_ids = torch.tensor([[0] * 3 + [1] * 9])
    predicate = sliding_window(4) & causal()
    q, k, v = (t.to(torch.bfloat16) for t in qkv(batch=1, heads=8, kv_heads=2, length=12, dim=16))
    out, _ = sdpa_varlen_attention(CAUSAL, q, k, v, span_masks(segment_ids, predicate), sliding_window=4,
                                   **flash_varlen_kwargs(segment_ids))
    assert sorted(calls) == [(False, 2, True), (True, 8, False)]
    expected = real_sdpa(q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
                         attn_mask=dense_mask(segment_ids, predicate)).transpose(1, 2)
    assert (out.float() - expected).abs().max().item() <= 2e-2


# preference pairs: a segment holding a prefix (branch 0), then a chosen (1) and a rejected (2) continuation
PAIR_SEGMENTS = torch.tensor([[0] * 9 + [1] * 2 + [-1], [0] * 3 + [1] * 9])
PAIR_BRANCHES = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2]])


def pair_kwargs(branches=PAIR_BRANCHES):
    kwargs = flash_varlen_kwargs(PAIR_SEGMENTS)
    carry_pair_parts(kwargs["cu_seq_lens_q"], branches)
    return kwargs


def test_pair_segments_merge_prefix_and_own_attention_exactly():
    """Each continuation's attention merged from its prefix and own parts (log-sum-exp) equals one sdpa call under
    the dense pair mask (a continuation sees the prefix and itself, never the other), output and every gradient, in
    float64, grouped-query heads included; the plain segments and the padding run beside the pairs unchanged."""
    assert pair_parts(pair_kwargs()["cu_seq_lens_q"]) == ((4, 3, 2), None, None, None, (3, 2, 4))
    q, k, v = (t.double().requires_grad_() for t in qkv(seed=3))
    out, _ = sdpa_varlen_attention(CAUSAL, q, k, v, None, **pair_kwargs())
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    mask = dense_mask(PAIR_SEGMENTS, causal() & same_branch_or_prefix(PAIR_BRANCHES))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert (out - expected).abs().max().item() <= 1e-12
    for got, want in zip(grads, torch.autograd.grad((expected * weights).sum(), (q, k, v))):
        assert (got - want).abs().max().item() <= 1e-12
    leaky, _ = sdpa_varlen_attention(CAUSAL, q, k, v, None, **flash_varlen_kwargs(PAIR_SEGMENTS))
    assert (leaky - expected).abs().max().item() > 1e-3  # plain causal segments would let a rejected see the chosen


def test_pair_segments_refused_where_the_merge_does_not_hold():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="for causal attention without dropout or sliding window only"):
        sdpa_varlen_attention(CAUSAL, q, k, v, None, dropout=0.1, **pair_kwargs())
    with pytest.raises(ValueError, match="for causal attention without dropout or sliding window only"):
        sdpa_varlen_attention(types.SimpleNamespace(is_causal=False), q, k, v, None, **pair_kwargs())
    with pytest.raises(ValueError, match="sdpa_varlen cannot soft-cap attention scores"):
        sdpa_varlen_attention(CAUSAL, q, k, v, None, softcap=30.0, **pair_kwargs())
    with pytest.raises(ValueError, match="merges a shared prefix's attention on the CPU only, not on meta"):
        prefix_merged_attention(*(t[:1].to("meta") for t in (q, k, v, k, v)))
    disordered = PAIR_BRANCHES.clone()
    disordered[0, 4], disordered[0, 7] = 2, 1
    with pytest.raises(ValueError, match=r"^row 0 column 5: a pair segment must be its prefix, then its chosen"):
        pair_kwargs(disordered)
    assert shared_prefix_obstacle("sdpa_varlen", "cpu") is None and shared_prefix_obstacle("sdpa", "cuda") is None
    assert shared_prefix_obstacle("flash_attention_2", "cuda") == "flash_attention_2 takes one causal span per segment"
