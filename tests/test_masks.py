"""Composable mask predicates (``mvp_engine.packing.masks``) and their forms (``mask_forms``): every form equals a
brute-force reference of the same predicate on random packed rows, the BlockMask is built without an L x L tensor,
``sdpa_varlen`` with per-span masks equals sdpa with the dense mask, and Gemma 3 / 4's own masks for one sequence
are the predicates the docstrings name."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from mvp_engine.packing import (
    SpanMasks,
    attention_mask_for,
    block_causal_mask,
    block_mask,
    causal,
    dense_mask,
    flash_varlen_kwargs,
    is_block_mask,
    layer_masks,
    same_block,
    sliding_window,
    span_masks,
)
from mvp_engine.packing.varlen_sdpa import sdpa_varlen_attention

# ------------------------------------------------------------------------------------------- brute-force reference

KINDS = ("causal", "full", "sliding", "window_or_block")


def predicate_of(kind: str, block_ids: torch.Tensor, window: int):
    block = same_block(block_ids)
    return {
        "causal": causal(),
        "full": causal() | block,
        "sliding": sliding_window(window) & (causal() | block),
        "window_or_block": (causal() & sliding_window(window)) | block,
    }[kind]


def reference(kind: str, segment_ids: torch.Tensor, block_ids: torch.Tensor, window: int) -> torch.Tensor:
    """(B, 1, L, L) bool, token by token in plain Python from the predicates' definitions."""
    batch, length = segment_ids.shape
    seg, blk = segment_ids.tolist(), block_ids.tolist()
    out = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                segment = seg[b][q] == seg[b][k]
                lo, hi = min(q, k), max(q, k)
                block = blk[b][q] >= 0 and all(blk[b][t] == blk[b][q] for t in range(lo, hi + 1)) and segment
                is_causal, in_window = k <= q, k > q - window
                out[b, 0, q, k] = segment and {
                    "causal": is_causal,
                    "full": is_causal or block,
                    "sliding": in_window and (is_causal or block),
                    "window_or_block": (is_causal and in_window) or block,
                }[kind]
    return out


@st.composite
def packed_rows(draw):
    """(segment_ids, block_ids): up to 3 rows of up to 3 segments (one maybe all padding), each a random string of
    text (-1) and blocks (ids restart per segment; neighbouring blocks may touch), then 0..3 tokens of padding."""
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        row = []
        for seg in range(draw(st.integers(0, 3))):
            pieces = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), min_size=1, max_size=4))
            next_id = 0
            for is_block, n in pieces:
                row += [(seg, next_id if is_block else -1)] * n
                next_id += is_block
        rows.append(row)
    length = max(len(r) for r in rows) + draw(st.integers(0 if any(rows) else 1, 3))
    segment_ids = torch.full((len(rows), length), -1, dtype=torch.long)
    block_ids = torch.full((len(rows), length), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for t, (seg, blk) in enumerate(row):
            segment_ids[b, t], block_ids[b, t] = seg, blk
    return segment_ids, block_ids


cases = st.tuples(packed_rows(), st.sampled_from(KINDS), st.integers(1, 6))


@settings(max_examples=80, deadline=None)
@given(cases)
def test_dense_mask_is_the_reference(case):
    (segment_ids, block_ids), kind, window = case
    predicate = predicate_of(kind, block_ids, window)
    expected = reference(kind, segment_ids, block_ids, window)
    assert torch.equal(dense_mask(segment_ids, predicate), expected)
    assert expected.any(-1).all(), "every token sees itself: no NaN rows"
    additive = dense_mask(segment_ids, predicate, dtype=torch.float32)
    assert torch.equal(additive == 0, expected) and bool((additive[~expected] == torch.finfo(torch.float32).min).all())


def listed_blocks(num: torch.Tensor, indices: torch.Tensor, blocks: int) -> torch.Tensor:
    """(B, q blocks, kv blocks) bool of the key blocks a BlockMask lists per query block."""
    out = torch.zeros(num.shape[0], blocks, blocks, dtype=torch.bool)
    for b in range(num.shape[0]):
        for qb in range(blocks):
            out[b, qb, indices[b, 0, qb, : int(num[b, 0, qb])].long()] = True
    return out


@settings(max_examples=80, deadline=None)
@given(cases, st.sampled_from([1, 2, 3, 4, 128]))
def test_block_mask_agrees_with_the_dense_mask(case, block_size):
    """The mask_mod is the dense pattern; the listed blocks hold every allowed pair (partial or full) and a full
    block (mask_mod skipped) holds only allowed pairs. Small blocks make every block-pair case occur."""
    from torch.nn.attention.flex_attention import create_mask

    (segment_ids, block_ids), kind, window = case
    predicate = predicate_of(kind, block_ids, window)
    mask = block_mask(segment_ids, predicate, block_size=block_size)
    batch, length = segment_ids.shape
    dense = dense_mask(segment_ids, predicate)
    assert torch.equal(create_mask(mask.mask_mod, batch, 1, length, length, device="cpu"), dense)
    blocks = -(-length // block_size)
    partial = listed_blocks(mask.kv_num_blocks, mask.kv_indices, blocks)
    full = listed_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, blocks)
    padded = torch.zeros(batch, blocks * block_size, blocks * block_size, dtype=torch.bool)
    padded[:, :length, :length] = dense[:, 0]
    per_block = padded.reshape(batch, blocks, block_size, blocks, block_size)
    inside = torch.zeros_like(padded)
    inside[:, :length, :length] = True
    assert not (partial & full).any()
    assert not (per_block.any(dim=(2, 4)) & ~(partial | full)).any(), "an allowed pair in a skipped block"
    assert not (full & ~(per_block | ~inside.reshape_as(per_block)).all(dim=(2, 4))).any()
    if kind == "causal":  # the block-causal case lists exactly the blocks with an allowed pair
        assert torch.equal(partial | full, per_block.any(dim=(2, 4)))


@settings(max_examples=60, deadline=None)
@given(packed_rows())
def test_block_causal_case_is_todays_mask(rows):
    segment_ids, _ = rows
    runs = torch.cat([torch.zeros(segment_ids.shape[0], 1, dtype=torch.long),
                      (segment_ids[:, 1:] != segment_ids[:, :-1]).long()], 1).cumsum(-1)
    length = segment_ids.shape[1]
    old = ((runs[:, :, None] == runs[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril())[:, None]
    assert torch.equal(block_causal_mask(segment_ids), old)
    assert torch.equal(dense_mask(segment_ids), old)


@settings(max_examples=60, deadline=None)
@given(cases)
def test_span_masks_are_the_dense_mask_per_run(case):
    (segment_ids, block_ids), kind, window = case
    predicate = predicate_of(kind, block_ids, window)
    spans = span_masks(segment_ids, predicate)
    dense = dense_mask(segment_ids, predicate)
    assert torch.equal(spans.cu_seq_lens, flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"])
    length = segment_ids.shape[1]
    bounds = spans.cu_seq_lens.tolist()
    for (start, end), mask in zip(zip(bounds[:-1], bounds[1:]), spans.masks):
        row, first = divmod(start, length)
        expected = dense[row, 0, first:first + end - start, first:first + end - start]
        n = end - start
        if mask is None:
            assert torch.equal(expected, torch.ones(n, n, dtype=torch.bool).tril())
        else:
            assert torch.equal(mask, expected) and not torch.equal(mask, torch.ones(n, n, dtype=torch.bool).tril())


CAUSAL_MODULE = types.SimpleNamespace(is_causal=True)


@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_varlen_with_span_masks_equals_sdpa_with_the_dense_mask(kind):
    """Outputs and gradients of q, k, v <= 1e-6 (float64: float32 kernels differ by rounding, 1.4e-6 measured):
    several blocks per segment, a window shorter than a segment, blocks crossing the window, a padding run, GQA."""
    segment_ids = torch.tensor([[0] * 9 + [1] * 7 + [-1] * 2, [0] * 4 + [1] * 14])
    block_ids = torch.tensor([[-1, 0, 0, 0, 0, -1, 1, 1, -1, -1, 0, 0, 0, -1, -1, -1, -1, -1],
                              [-1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, -1, 1, 1, -1, -1, -1, -1]])
    predicate = predicate_of(kind, block_ids, 3)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 18, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 18, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    spans = span_masks(segment_ids, predicate)
    out, _ = sdpa_varlen_attention(CAUSAL_MODULE, q, k, v, spans, sliding_window=3, **flash_varlen_kwargs(segment_ids))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=dense_mask(segment_ids, predicate)).transpose(1, 2)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert (out - expected).abs().max().item() <= 1e-6
    for grad, ref in zip(grads, expected_grads):
        assert (grad - ref).abs().max().item() <= 1e-6
    assert (kind == "causal") == all(mask is None for mask in spans.masks)


def test_sdpa_varlen_refuses_a_window_it_would_drop():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    with pytest.raises(ValueError, match="sliding_window=3 but no SpanMasks"):
        sdpa_varlen_attention(CAUSAL_MODULE, q, k, v, None, sliding_window=3,
                              **flash_varlen_kwargs(torch.zeros(1, 6, dtype=torch.long)))
    spans = span_masks(torch.zeros(1, 6, dtype=torch.long), sliding_window(3) & causal())
    with pytest.raises(ValueError, match="disagree with the SpanMasks"):
        sdpa_varlen_attention(CAUSAL_MODULE, q, k, v, spans, cu_seq_lens_q=torch.tensor([0, 3, 6], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------- no L x L tensor


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op produces while active."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_block_mask_allocates_no_l_by_l_tensor():
    """At L = 16 k the largest tensor built is O(B x L) (the per-token runs), not L² = 268 M elements."""
    length, batch = 16384, 2
    segment_ids = torch.arange(length).div(3000, rounding_mode="floor").repeat(batch, 1)
    segment_ids[1, -500:] = -1
    block_ids = torch.where(torch.arange(length) % 700 < 300, torch.arange(length) // 700, -1).repeat(batch, 1)
    with LargestTensor() as probe:
        mask = block_mask(segment_ids, sliding_window(512) & (causal() | same_block(block_ids)))
    assert probe.largest <= 4 * batch * length, probe.largest
    assert tuple(mask.shape) == (batch, 1, length, length)


# --------------------------------------------------------------------------------------------- forms per backend


def test_layer_masks_per_backend():
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    block_ids = torch.tensor([[-1, 0, 0, -1, 0, -1]])
    predicates = {"full_attention": causal() | same_block(block_ids),
                  "sliding_attention": sliding_window(2) & (causal() | same_block(block_ids))}
    for attn, check in (("eager", lambda m: m.dtype == torch.float32), ("sdpa", lambda m: m.dtype == torch.bool),
                        ("flex_attention", is_block_mask), ("sdpa_varlen", lambda m: isinstance(m, SpanMasks))):
        masks = layer_masks(segment_ids, predicates, attn, torch.float32)
        assert set(masks) == set(predicates) and all(check(m) for m in masks.values())
    sdpa = layer_masks(segment_ids, predicates, "sdpa", torch.float32)
    assert torch.equal(sdpa["full_attention"], dense_mask(segment_ids, predicates["full_attention"]))
    assert torch.equal(attention_mask_for(segment_ids, "sdpa", torch.float32), block_causal_mask(segment_ids))
    with pytest.raises(ValueError, match="cu_seq_lens"):
        layer_masks(segment_ids, predicates, "flash_attention_2", torch.float32)


def test_flex_attention_with_the_block_mask_equals_sdpa():
    from torch.nn.attention.flex_attention import flex_attention

    segment_ids = torch.tensor([[0] * 5 + [1] * 3, [0] * 8])
    block_ids = torch.tensor([[-1, 0, 0, 0, -1, 0, 0, -1], [0, 0, 0, 0, 0, -1, -1, -1]])
    predicate = sliding_window(2) & (causal() | same_block(block_ids))
    q, k, v = (torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": intended here
        out = flex_attention(q, k, v, block_mask=block_mask(segment_ids, predicate, block_size=2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(segment_ids, predicate))
    assert (out - ref).abs().max().item() <= 1e-6


# ------------------------------------------------------------------------- Gemma's own masks for one sequence


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@settings(max_examples=20, deadline=None)
@given(token_types=st.lists(st.sampled_from([0, 1]), min_size=1, max_size=14), window=st.integers(1, 6))
def test_gemma_masks_for_one_sequence_are_the_predicates(family, token_types, window):
    """transformers' ``create_masks_for_vision_model`` (one unpacked sequence, sdpa): Gemma 3's full layers are
    ``causal | same_block``, Gemma 4's plain ``causal``, both sliding layers ``window & (causal | same_block)`` (an
    image token sees its block's later tokens, never earlier ones beyond the window)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = types.SimpleNamespace(sliding_window=window, _attn_implementation="sdpa", is_causal=True)
    token_type_ids = torch.tensor([token_types])
    length = token_type_ids.shape[1]
    block_ids = module.get_block_sequence_ids_for_mask(token_type_ids, device="cpu")
    theirs = module.create_masks_for_vision_model(config, torch.zeros(1, length, 4), None, None,
                                                  torch.arange(length)[None], block_ids)
    block = same_block(block_ids)
    ours = {"full_attention": causal() | block if family == "gemma3" else causal(),
            "sliding_attention": sliding_window(window) & (causal() | block)}
    segment_ids = torch.zeros(1, length, dtype=torch.long)
    for layer_type, predicate in ours.items():
        mask = theirs[layer_type]  # None: sdpa's is_causal skip, a plain causal mask
        mask = torch.ones(length, length, dtype=torch.bool).tril() if mask is None else mask
        assert torch.equal(dense_mask(segment_ids, predicate), mask.expand(1, 1, length, length))


@pytest.fixture(scope="module")
def tiny_hybrid_model():
    """A tiny random Gemma 3 text model (no downloads): a sliding and a full layer, window 3, GQA."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                              layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    return Gemma3TextModel(config).double().eval()


def test_prepared_layer_dict_through_a_hybrid_model(tiny_hybrid_model):
    """The per-layer-type dict reaches each layer as prepared (the model builds no mask of its own): eager, sdpa and
    sdpa_varlen (span masks) give the same hidden states and gradients (float64), and the guards accept each form."""
    from mvp_engine.packing import check_packed_model_kwargs, segment_positions

    model = tiny_hybrid_model
    segment_ids = torch.tensor([[0] * 7 + [1] * 6 + [-1] * 3])
    block_ids = torch.tensor([[-1, 0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, -1, -1, -1, -1]])
    predicates = {"full_attention": causal() | same_block(block_ids),
                  "sliding_attention": sliding_window(3) & (causal() | same_block(block_ids))}
    input_ids = torch.randint(0, 32, segment_ids.shape, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = {}
    for attn in ("eager", "sdpa", "sdpa_varlen"):
        model.config._attn_implementation = attn
        kwargs = {"input_ids": input_ids, "position_ids": segment_positions(segment_ids), "use_cache": False,
                  "attention_mask": layer_masks(segment_ids, predicates, attn, torch.float64)}
        if attn == "sdpa_varlen":
            kwargs.update(flash_varlen_kwargs(segment_ids))
        check_packed_model_kwargs(kwargs, attn, position_rows=1)
        model.zero_grad()
        hidden = model(**kwargs).last_hidden_state
        (hidden * weights).sum().backward()  # a fixed projection: well-conditioned gradients (a sum of squares
        # through the final norm cancels to 1e-4 and turns float32 rounding into 20 %)
        results[attn] = hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.config._attn_implementation = "sdpa"
    ref_hidden, ref_grads = results["sdpa"]
    # relative to each tensor's largest entry; eager's softmax runs in float32 (transformers upcasts it): 4e-7
    # measured, while sdpa_varlen stays in float64
    for attn, tolerance in (("eager", 1e-5), ("sdpa_varlen", 1e-10)):
        hidden, grads = results[attn]
        for ours, ref in zip([hidden, *grads], [ref_hidden, *ref_grads]):
            assert (ours - ref).abs().max().item() <= tolerance * ref.abs().max().item()
    no_window = dense_mask(segment_ids, causal() | same_block(block_ids))
    assert not torch.equal(no_window, dense_mask(segment_ids, predicates["sliding_attention"])), "window cuts in"
    with pytest.raises(ValueError, match="SpanMasks are read by sdpa_varlen only"):
        check_packed_model_kwargs({"attention_mask": layer_masks(segment_ids, predicates, "sdpa_varlen",
                                                                torch.float64), "use_cache": False}, "sdpa")
