"""``mvp_engine.packing.linear_attention``: the boundary-aware replacements of transformers' Gated DeltaNet torch
functions equal the reference run on each sample alone (forward and gradients), change nothing without boundaries,
install idempotently and only where a model has linear-attention layers; the guard refuses a packed forward that
would leak. Model-level packed == one-by-one is ``recipes/qwen3_5/tests/test_packed_equivalence.py``."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from mvp_engine.packing import (
    enable_linear_attention_packing,
    ensure_linear_attention_boundaries,
    flash_varlen_kwargs,
    has_linear_attention,
    linear_attention,
    linear_attention_enabled,
    prepare_packed_inputs,
    text_positions,
)
from mvp_engine.packing.linear_attention import _MARK, CHUNK_RULE, CONV, _varlen_chunk_rule, _varlen_conv1d

from .test_attention_helpers import segment_ids_from_lengths

TOL = 1e-5
LAYERS = (qwen3_5.Qwen3_5GatedDeltaNet,)  # what recipes/qwen3_5 declares boundary-aware
LENGTHS = [[3, 70, 1, 20], [66, 30]]  # a sample over one chunk (64), a 1-token one, two rows of 94 and 96 tokens


def _spans(segment_ids):
    """(row, start, end) of every run (padding runs included, as cu_seq_lens_q holds them)."""
    bounds = flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"].tolist()
    width = segment_ids.shape[1]
    return [(a // width, a % width, a % width + (b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def _original(module, name):
    """transformers' own function, whether or not this process installed the wrapper already."""
    current = getattr(module, name)
    return current.__wrapped__ if getattr(current, _MARK, False) else current


@pytest.fixture(scope="module")
def segment_ids():
    return segment_ids_from_lengths(LENGTHS, max(sum(row) for row in LENGTHS))


def test_conv1d_with_boundaries_equals_each_sample_alone(segment_ids):
    torch.manual_seed(0)
    batch, width = segment_ids.shape
    x = torch.randn(batch, 12, width, requires_grad=True)
    weight = torch.randn(12, 4, requires_grad=True)
    original = _original(qwen3_5, CONV)
    wrapped = _varlen_conv1d(original)
    bounds = flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"]
    packed = wrapped(x, weight, None, activation="silu", cu_seq_lens_q=bounds, max_length_q=99)
    packed.square().sum().backward()
    packed_grads = [x.grad.clone(), weight.grad.clone()]
    x.grad = weight.grad = None
    alone = torch.zeros_like(packed)
    for row, start, end in _spans(segment_ids):
        alone[row, :, start:end] = original(x[row:row + 1, :, start:end], weight, None, activation="silu")[0]
    assert (packed - alone).abs().max().item() <= TOL
    alone.square().sum().backward()
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(packed_grads, [x.grad, weight.grad]))
    leaky = original(x, weight, None, activation="silu")  # what transformers computes: windows cross samples
    assert (leaky - alone).abs().max().item() > 1e-2


def test_chunk_rule_with_boundaries_equals_each_sample_alone(segment_ids):
    torch.manual_seed(0)
    batch, width = segment_ids.shape
    heads, dim = 2, 8
    q, k, v = (torch.randn(batch, width, heads, dim, requires_grad=True) for _ in range(3))
    g = (-torch.rand(batch, width, heads) * 0.2).requires_grad_()
    beta = torch.rand(batch, width, heads).requires_grad_()
    inputs = (q, k, v, g, beta)
    original = _original(qwen3_5, CHUNK_RULE)
    wrapped = _varlen_chunk_rule(original)
    bounds = flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"]
    packed, states = wrapped(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                             cu_seqlens=bounds)
    packed.square().sum().backward()
    packed_grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    alone = torch.zeros_like(packed)
    for index, (row, start, end) in enumerate(_spans(segment_ids)):
        out, state = original(*(t[row:row + 1, start:end] for t in (q, k, v)), g=g[row:row + 1, start:end],
                              beta=beta[row:row + 1, start:end], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        alone[row, start:end] = out[0]
        assert (states[index] - state[0]).abs().max().item() <= TOL  # per-sample final states, as fla returns
    assert (packed - alone).abs().max().item() <= TOL
    alone.square().sum().backward()
    assert all((a - t.grad).abs().max().item() <= 1e-4 for a, t in zip(packed_grads, inputs))
    leaky, _ = original(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)  # one state through every sample
    assert (leaky - alone).abs().max().item() > 1e-2


def test_without_boundaries_the_wrappers_are_the_original():
    torch.manual_seed(1)
    x, weight = torch.randn(2, 6, 40), torch.randn(6, 4)
    conv = _original(qwen3_5, CONV)
    assert torch.equal(_varlen_conv1d(conv)(x, weight, None, activation="silu"), conv(x, weight, None, "silu"))
    q, k, v = (torch.randn(2, 40, 2, 8) for _ in range(3))
    g, beta = -torch.rand(2, 40, 2), torch.rand(2, 40, 2)
    rule = _original(qwen3_5, CHUNK_RULE)
    assert torch.equal(_varlen_chunk_rule(rule)(q, k, v, g=g, beta=beta)[0], rule(q, k, v, g=g, beta=beta)[0])


def _tiny_text_model(layer_types=("linear_attention", "full_attention")) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=list(layer_types), pad_token_id=0)
    return Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa")


def test_install_is_idempotent_and_scoped(monkeypatch):
    for name in (CONV, CHUNK_RULE):  # start from transformers' own functions, restored after the test
        monkeypatch.setattr(qwen3_5, name, _original(qwen3_5, name))
    next_before = {name: getattr(qwen3_next, name) for name in (CONV, CHUNK_RULE)}
    model = _tiny_text_model()
    assert has_linear_attention(model) and not linear_attention_enabled(model)
    enable_linear_attention_packing(model, LAYERS)
    installed = {name: getattr(qwen3_5, name) for name in (CONV, CHUNK_RULE)}
    assert all(getattr(f, _MARK) for f in installed.values()) and linear_attention_enabled(model)
    enable_linear_attention_packing(model, LAYERS)  # a second call (a second model) wraps nothing twice
    assert {name: getattr(qwen3_5, name) for name in (CONV, CHUNK_RULE)} == installed
    assert installed[CONV].__wrapped__ is _original(qwen3_5, CONV)
    # a model without linear-attention layers is left alone, and so is every other model family's module
    plain = _tiny_text_model(layer_types=["full_attention", "full_attention"])
    assert not has_linear_attention(plain) and enable_linear_attention_packing(plain, LAYERS) is plain
    assert {name: getattr(qwen3_next, name) for name in (CONV, CHUNK_RULE)} == next_before


def _packed_batch():
    segment_ids = torch.tensor([[0] * 5 + [1] * 6 + [-1] * 2])
    return {"input_ids": torch.randint(1, 60, segment_ids.shape), "pack_segment_ids": segment_ids}


def test_guard_refuses_a_model_whose_linear_layers_ignore_boundaries(monkeypatch):
    for name in (CONV, CHUNK_RULE):
        monkeypatch.setattr(qwen3_5, name, _original(qwen3_5, name))
    model = _tiny_text_model()
    batch = _packed_batch()
    with pytest.raises(ValueError, match="enable_linear_attention_packing"):
        prepare_packed_inputs(batch, model, "sdpa", position_ids=text_positions(batch), position_rows=1, media={})


def test_guard_refuses_a_packed_forward_without_boundaries():
    model = enable_linear_attention_packing(_tiny_text_model(), LAYERS)
    batch = _packed_batch()
    kwargs = prepare_packed_inputs(batch, model, "sdpa", position_ids=text_positions(batch), position_rows=1,
                                   media={})
    assert kwargs["attention_mask"].dim() == 4 and kwargs["cu_seq_lens_q"].tolist() == [0, 5, 11, 13]
    ensure_linear_attention_boundaries(model, kwargs)
    without = {k: v for k, v in kwargs.items() if k != "cu_seq_lens_q"}
    with pytest.raises(ValueError, match="needs cu_seq_lens_q"):
        ensure_linear_attention_boundaries(model, without)
    short = {**kwargs, "cu_seq_lens_q": torch.tensor([0, 5, 11], dtype=torch.int32)}
    with pytest.raises(ValueError, match="all 13 tokens"):
        ensure_linear_attention_boundaries(model, short)


def test_an_unknown_linear_attention_layer_is_refused():
    model = _tiny_text_model()

    class OtherGatedDeltaNet(torch.nn.Module):
        pass

    model.model.layers[0].linear_attn = OtherGatedDeltaNet()
    with pytest.raises(NotImplementedError, match=r"lists 1 linear-attention layers, 0 of them of the classes declared "
                                                  r"boundary-aware \(\['Qwen3_5GatedDeltaNet'\]\)"):
        enable_linear_attention_packing(model, LAYERS)


def test_a_replaced_linear_attention_forward_is_refused():
    """A hub kernel (``kernels``' kernelize) or a patch may replace the layer's forward, which then need not call the
    module functions the wrappers replace: unverified, so refused."""
    model = _tiny_text_model()
    layer = model.model.layers[0].linear_attn
    layer.forward = lambda *args, **kwargs: None
    with pytest.raises(NotImplementedError, match="replaced forward"):
        enable_linear_attention_packing(model, LAYERS)


def test_the_gated_delta_rule_runs_fla_on_cuda_where_installed_else_the_torch_reference(monkeypatch):
    """What packed linear-attention layers run and why (the start line's words): fla's varlen kernel only on CUDA
    with flash-linear-attention importable; the exact per-sample reference on the CPU and without fla."""
    monkeypatch.setattr(linear_attention, "fla_chunk_rule", lambda: None)
    assert linear_attention.chunk_rule_kernel("cuda")[0] == linear_attention.TORCH_REFERENCE
    assert "flash-linear-attention is not installed" in linear_attention.chunk_rule_kernel("cuda")[1]
    monkeypatch.setattr(linear_attention, "fla_chunk_rule", lambda: _fla_stand_in)
    assert linear_attention.chunk_rule_kernel("cpu")[0] == linear_attention.TORCH_REFERENCE
    assert linear_attention.chunk_rule_kernel("cuda")[0] == linear_attention.FLA_KERNEL
    line = linear_attention.describe_linear_attention(_tiny_text_model(), "cuda")
    assert line == "linear attention: fla chunk_gated_delta_rule over the flattened batch with cu_seqlens (CUDA, fla " \
                   "installed)"
    assert linear_attention.describe_linear_attention(_tiny_text_model(("full_attention",) * 2), "cuda") is None


def _fla_stand_in(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens):
    """fla's contract on the CPU: one row of packed sequences (batch 1), int64 ``cu_seqlens``, no initial state;
    computed by the reference path on that one row."""
    assert query.shape[0] == 1 and cu_seqlens.dtype == torch.long and initial_state is None
    _fla_stand_in.calls += 1
    return _varlen_chunk_rule(_original(qwen3_5, CHUNK_RULE))(
        query, key, value, g=g, beta=beta, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def test_the_fla_path_hands_the_kernel_one_flattened_row_and_gives_what_the_reference_gives(segment_ids,
                                                                                            monkeypatch):
    torch.manual_seed(0)
    batch, width = segment_ids.shape
    q, k, v = (torch.randn(batch, width, 2, 8) for _ in range(3))
    g, beta = -torch.rand(batch, width, 2) * 0.2, torch.rand(batch, width, 2)
    bounds = flash_varlen_kwargs(segment_ids)["cu_seq_lens_q"]
    reference, states = _varlen_chunk_rule(_original(qwen3_5, CHUNK_RULE))(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    _fla_stand_in.calls = 0
    out, fla_states = linear_attention.fla_varlen(_fla_stand_in, q, k, v, g, beta, 64, True, True, bounds)
    assert _fla_stand_in.calls == 1 and torch.equal(out, reference) and torch.equal(fla_states, states)
    # on CPU tensors the wrapper keeps the reference even where fla imports
    monkeypatch.setattr(linear_attention, "fla_chunk_rule", lambda: _fla_stand_in)
    again, _ = _varlen_chunk_rule(_original(qwen3_5, CHUNK_RULE))(q, k, v, g=g, beta=beta, cu_seqlens=bounds,
                                                                   use_qk_l2norm_in_kernel=True)
    assert _fla_stand_in.calls == 1 and torch.equal(again, reference)
