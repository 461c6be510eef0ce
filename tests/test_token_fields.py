"""Per-token type fields (``token_type_ids``, ``mm_token_type_ids``) through the DataKit (sample -> pack -> collator,
padded with the inactive 0), the bidirectional blocks derived from them per segment, and ``prepare_packed_inputs``
emitting one mask per layer type with the sliding window read from the model's config when the batch is prepared."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMPack, MLLMSample
from mvp_engine.packing import (
    SpanMasks,
    batch_type_blocks,
    causal,
    dense_mask,
    layer_predicates,
    prepare_packed_inputs,
    same_block,
    sliding_window,
    text_positions,
    type_blocks,
)


def sample(name: str, types: list[int], field: str | None = "token_type_ids") -> MLLMSample:
    ids = torch.arange(10, 10 + len(types))
    fields = {field: torch.tensor(types)} if field else {}
    return MLLMSample(input_ids=ids, labels=ids.clone(), sample_id=name, token_fields=fields)


def collate(rows: list[list[MLLMSample]], width: int) -> dict:
    return MLLMCollator(pad_token_id=0, pad_to_multiple_of=width)([MLLMPack(row).to_model_inputs() for row in rows])


def test_type_ids_are_packed_and_padded_with_the_inactive_value():
    """The issue's [t i i t] [t t i i i t] pack, a sample without the field (text, 0) and an all-padding row."""
    batch = collate([[sample("a", [0, 1, 1, 0]), sample("b", [0, 0, 1, 1, 1, 0]), sample("c", [5] * 2, None)], []],
                    width=14)
    assert batch["token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0], [0] * 14]
    assert "token_type_ids" not in batch["sample_ids"] and batch["input_ids"].shape == (2, 14)
    blocks = batch_type_blocks(batch, "token_type_ids")
    assert blocks.tolist() == [[-1, 0, 0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1], [-1] * 14]


def test_blocks_split_at_segment_and_type_changes():
    """An image run that ends one segment and one that starts the next are two blocks; so are adjacent runs of
    different types (an image then a video), and ``kinds`` keeps only the types asked for."""
    types = torch.tensor([[1, 1, 1, 2, 2, 0, 1]])
    segments = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    assert type_blocks(types, segments).tolist() == [[0, 0, 1, 2, 2, -1, 3]]
    assert type_blocks(types, segments, kinds=[1]).tolist() == [[0, 0, 1, -1, -1, -1, 2]]


def test_unknown_token_field_and_misaligned_field_name_the_sample():
    with pytest.raises(ValueError, match="'s1'.*'segment_type'.*TOKEN_FIELD_PADS"):
        MLLMSample(input_ids=torch.arange(3), labels=torch.arange(3), sample_id="s1",
                   token_fields={"segment_type": torch.zeros(3)})
    with pytest.raises(ValueError, match="'s2'.*token_type_ids.*shape"):
        MLLMSample(input_ids=torch.arange(3), labels=torch.arange(3), sample_id="s2",
                   token_fields={"token_type_ids": torch.zeros(2)})


def test_truncation_cuts_the_token_fields_with_the_ids():
    cut = sample("a", [0, 1, 1, 0, 0, 0]).truncated(4)
    assert cut.token_fields["token_type_ids"].tolist() == [0, 1, 1, 0]


def test_a_batch_without_the_type_field_is_refused():
    batch = collate([[sample("a", [0, 0], None)]], width=4)
    with pytest.raises(ValueError, match="no 'token_type_ids'.*silently drops"):
        batch_type_blocks(batch, "token_type_ids")


def test_an_all_padding_batch_has_no_blocks_and_needs_no_type_field():
    """A short rank's step is one empty pack (no samples, so no token fields): nothing to refuse, no block."""
    batch = collate([[]], width=4)
    assert "token_type_ids" not in batch
    assert batch_type_blocks(batch, "token_type_ids").tolist() == [[-1, -1, -1, -1]]


@pytest.fixture(scope="module")
def hybrid():
    """A tiny random Gemma 3 text model: one sliding and one full layer."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
                              layer_types=["sliding_attention", "full_attention"])
    return Gemma3TextModel(config)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sdpa_varlen", "flex_attention"])
def test_prepare_packed_inputs_emits_one_mask_per_layer_type(hybrid, backend):
    batch = collate([[sample("a", [0, 1, 1, 0]), sample("b", [0, 0, 1, 1, 1, 0])]], width=12)
    hybrid.config._attn_implementation = backend
    blocks = batch_type_blocks(batch, "token_type_ids")
    kwargs = prepare_packed_inputs(batch, hybrid, backend, position_ids=text_positions(batch), position_rows=1,
                                   media={}, block_ids=blocks)
    masks = kwargs["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    if backend == "sdpa":
        segment_ids = batch["pack_segment_ids"]
        assert torch.equal(masks["full_attention"], dense_mask(segment_ids, causal() | same_block(blocks)))
        sliding = masks["sliding_attention"][0, 0]
        window_or_block = sliding_window(3) & (causal() | same_block(blocks))
        assert torch.equal(sliding[None, None], dense_mask(segment_ids, window_or_block))
        assert sliding[5].tolist()[4:10] == [True, True, False, False, False, False]  # no future image token
        assert sliding[6, 6:9].all() and sliding[8, 6:9].all()  # the second sample's image block is bidirectional
    if backend == "sdpa_varlen":
        assert all(isinstance(mask, SpanMasks) for mask in masks.values()) and "cu_seq_lens_q" in kwargs


def test_the_window_is_read_from_the_config_at_call_time(hybrid):
    segment_ids = torch.zeros(1, 8, dtype=torch.long)
    hybrid.config.sliding_window = 2
    narrow = dense_mask(segment_ids, layer_predicates(hybrid.config)["sliding_attention"])
    hybrid.config.sliding_window = 5
    wide = dense_mask(segment_ids, layer_predicates(hybrid.config)["sliding_attention"])
    hybrid.config.sliding_window = 3
    assert int(narrow.sum()) < int(wide.sum()) and torch.equal(wide & narrow, narrow)
    blocks = torch.tensor([[-1, 0, 0, -1, -1, -1, -1, -1]])
    only_sliding = layer_predicates(hybrid.config, blocks, block_layer_types=("sliding_attention",))
    assert torch.equal(dense_mask(segment_ids, only_sliding["full_attention"]), dense_mask(segment_ids, causal()))


def test_bad_layer_configs_are_refused(hybrid):
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="linear_attention"):
        layer_predicates(SimpleNamespace(layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(ValueError, match="sliding_window=None"):
        layer_predicates(SimpleNamespace(layer_types=["sliding_attention"], sliding_window=None))
    batch = collate([[sample("a", [0, 1, 1, 0])]], width=6)
    hybrid.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2 cannot take this model's per-layer masks"):
        prepare_packed_inputs(batch, hybrid, "flash_attention_2", position_ids=text_positions(batch),
                              position_rows=1, media={})
    hybrid.config._attn_implementation = "sdpa"
