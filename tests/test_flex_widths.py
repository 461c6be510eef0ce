"""flex_attention batches pad to a few row widths (``flex_row_widths``, chosen by ``row_widths.run_collator``), so
the compiled flex kernel and the BlockMask shapes repeat: packed batches of five lengths in one width compile flex
once, where the longest row's own width compiles it twice (the second kernel dynamic: the one torch 2.13's CPU flex
template fails to build). Compiles are counted with dynamo's ``CompileCounter`` backend, which runs the graph
eagerly, so no kernel is built here: what is counted is dynamo's decision to compile."""

from __future__ import annotations

import types

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers.integrations import flex_attention as transformers_flex

from mvp_engine.engine import row_widths
from mvp_engine.engine.config import DemoSpec, RunSpecs, TrainSpec
from mvp_engine.kit.mllm.data import MLLMCollator, MLLMDataSpec, MLLMPack, MLLMSample
from mvp_engine.packing import batch_type_blocks, flex_row_widths, layer_predicates, packed_attention_kwargs
from mvp_engine.packing.backends import FLEX

SLIDING = types.SimpleNamespace(layer_types=["sliding_attention"], sliding_window=8)  # Gemma's richest mask
LENGTHS = (133, 150, 171, 200, 243)  # packed rows of five lengths, all in the 256 width
COMPILE = torch.compile


def test_flex_row_widths_are_powers_of_two_up_to_the_longest_pack_on_cuda_one_width_elsewhere():
    assert flex_row_widths(5000, cuda=True) == (128, 256, 512, 1024, 2048, 4096, 5120)
    assert flex_row_widths(4096, cuda=True) == (128, 256, 512, 1024, 2048, 4096)
    assert flex_row_widths(100, cuda=True) == (128,)
    assert flex_row_widths(5000, cuda=False) == (5120,)


def test_collator_pads_to_the_smallest_width_that_holds_the_longest_row():
    collator = MLLMCollator(0, widths=(256, 128))
    assert [collator.padded_length(n) for n in (1, 128, 129, 256, 300)] == [128, 128, 256, 256, 300]
    assert MLLMCollator(0, pad_to_multiple_of=3, widths=(128, 256)).padded_length(129) == 258  # the multiple wins
    with pytest.raises(ValueError, match="widths=\\[0\\] is invalid"):
        MLLMCollator(0, widths=(0,))


@pytest.mark.parametrize("cuda", [True, False])
def test_run_collator_pads_flex_rows_to_its_widths_unless_a_multiple_is_set(monkeypatch, cuda):
    monkeypatch.setattr(row_widths, "cuda_in_use", lambda: cuda)

    def collator(attention: str, multiple: int | None = None, cp_size: int = 1) -> MLLMCollator:
        specs = RunSpecs(MLLMDataSpec(max_seq_len=1000), DemoSpec(), TrainSpec(pad_to_multiple_of=multiple), attention)
        return row_widths.run_collator(0, specs, cp_size)

    assert collator(FLEX).widths == ((128, 256, 512, 1024) if cuda else (1024,))
    assert collator(FLEX, cp_size=2).pad_to_multiple_of == 2
    assert collator(FLEX, multiple=64).widths == () and collator("sdpa").widths == ()


def packed_batch(length: int, collator: MLLMCollator) -> dict:
    """Two rows: three samples with an image block in the middle one, and one sample ``length - 40`` long."""
    def sample(n: int, image: tuple[int, int] | None = None) -> MLLMSample:
        ids = torch.arange(n) + 10
        kinds = torch.zeros(n, dtype=torch.long)
        if image:
            kinds[image[0]:image[1]] = 1
        return MLLMSample(input_ids=ids, labels=ids.clone(), sample_id=str(n), token_fields={"token_type_ids": kinds})

    rows = [[sample(40), sample(length - 100, (5, 30)), sample(60)], [sample(length - 40)]]
    return collator([MLLMPack(row).to_model_inputs() for row in rows])


def flex_compiles(collator: MLLMCollator, monkeypatch) -> tuple[int, set]:
    """How often dynamo compiles transformers' flex attention over the packed batches of ``LENGTHS`` (Gemma's
    sliding-layer mask, window and image blocks, from the project's builders), and the BlockMasks' shapes."""
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: COMPILE(fn, backend=counter, **kwargs))
    for name, value in (("_instance", None), ("_is_flex_compiled", False), ("_compiled_flex_attention", None)):
        monkeypatch.setattr(transformers_flex.WrappedFlexAttention, name, value)  # compiled again, with the counter
    module = types.SimpleNamespace(training=False)
    mask_shapes = set()
    torch._dynamo.reset()
    try:
        for length in LENGTHS:
            batch = packed_batch(length, collator)
            predicates = layer_predicates(SLIDING, batch_type_blocks(batch, "token_type_ids"))
            masks = packed_attention_kwargs(batch, FLEX, torch.float32, predicates=predicates)["attention_mask"]
            width = batch["input_ids"].shape[1]
            q, k, v = torch.randn(2, 4, width, 16), torch.randn(2, 2, width, 16), torch.randn(2, 2, width, 16)
            for mask in masks.values():
                transformers_flex.flex_attention_forward(module, q, k, v, mask, scaling=0.25)
                mask_shapes.add((mask.shape, mask.kv_indices.shape, mask.full_kv_indices.shape))
    finally:
        torch._dynamo.reset()
    return counter.frame_count, mask_shapes


def test_flex_compiles_once_over_batches_of_one_width(monkeypatch):
    """One compile for five lengths in one width (every BlockMask of one shape); padded to the longest row instead,
    flex compiles again at the second length, with dynamic shapes (later lengths reuse that kernel)."""
    compiles, shapes = flex_compiles(MLLMCollator(0, widths=flex_row_widths(1024, cuda=True)), monkeypatch)
    assert compiles == 1 and shapes == {((2, 1, 256, 256), (2, 1, 2, 2), (2, 1, 2, 2))}
    compiles, shapes = flex_compiles(MLLMCollator(0), monkeypatch)
    assert compiles == 2 and len(shapes) == len(LENGTHS)
