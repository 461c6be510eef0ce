"""Media merging for both layouts seen in practice, with each item's segment and row kept."""

import pytest
import torch

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMMediaHandler, MLLMPack, MLLMSample


def sample(name, length, media=None, num_media=0):
    ids = torch.arange(length) + 1
    return MLLMSample(input_ids=ids, labels=ids.clone(), sample_id=name, media=media or {}, num_media=num_media)


def test_stacked_images_llava_layout():
    a = sample("a", 5, {"pixel_values": torch.zeros(2, 3, 4, 4)}, 2)
    b = sample("b", 3)
    c = sample("c", 4, {"pixel_values": torch.ones(1, 3, 4, 4)}, 1)
    merged = MLLMMediaHandler().merge_pack([a, b, c])
    assert merged["pixel_values"].shape == (3, 3, 4, 4)
    assert merged["media_segment_ids"].tolist() == [0, 0, 2]
    assert merged["pixel_values"][2].eq(1).all()


def test_patches_and_grids_qwen_layout_across_a_batch():
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    a = sample("a", 6, {"pixel_values": torch.randn(12, 8), "image_grid_thw": grid}, 2)
    b = sample("b", 4, {"pixel_values": torch.randn(4, 8), "image_grid_thw": grid[:1]}, 1)
    rows = [MLLMPack([a]).to_model_inputs(), MLLMPack([sample("t", 2), b]).to_model_inputs()]
    batch = MLLMCollator(pad_token_id=0)(rows)
    assert batch["pixel_values"].shape == (16, 8)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    assert batch["media_segment_ids"].tolist() == [0, 0, 1]
    assert batch["media_batch_index"].tolist() == [0, 0, 1]


def test_inconsistent_media_is_named():
    bad_rows = sample("bad", 5, {"pixel_values": torch.zeros(3, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}, 1)
    with pytest.raises(ValueError, match=r"sample 'bad': media field 'pixel_values' has 3 rows, expected 4"):
        MLLMMediaHandler().merge_pack([bad_rows])
    stacked = sample("s", 5, {"pixel_values": torch.zeros(2, 3, 4, 4)}, 1)
    with pytest.raises(ValueError, match=r"sample 's': media field 'pixel_values' has 2 rows, expected 1"):
        MLLMMediaHandler().merge_pack([stacked])
    other = sample("o", 5, {"images": torch.zeros(1, 3, 4, 4)}, 1)
    good = sample("g", 5, {"pixel_values": torch.zeros(1, 3, 4, 4)}, 1)
    with pytest.raises(ValueError, match=r"sample 'o': media fields \['images'\] differ"):
        MLLMMediaHandler().merge_pack([good, other])
