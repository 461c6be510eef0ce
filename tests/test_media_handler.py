"""Media merging for both layouts seen in practice, images and videos side by side, with each item's segment and row
kept."""

import pytest
import torch

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMMediaHandler, MLLMPack, MLLMSample
from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS

# a model's own fields, declared as its encoder declares them (the kit's kinds name none)
TILED = IMAGES.with_fields(count_key="image_num_patches")
TIMED = VIDEOS.with_fields(item_keys=("second_per_grid_ts",))


def sample(name, length, media=None, num_media=0, kinds=()):
    ids = torch.arange(length) + 1
    return MLLMSample(input_ids=ids, labels=ids.clone(), sample_id=name, media=media or {}, num_media=num_media,
                      media_kinds=kinds)


def test_stacked_images_llava_layout():
    a = sample("a", 5, {"pixel_values": torch.zeros(2, 3, 4, 4)}, 2)
    b = sample("b", 3)
    c = sample("c", 4, {"pixel_values": torch.ones(1, 3, 4, 4)}, 1)
    merged = MLLMMediaHandler().merge_pack([a, b, c])
    assert merged["pixel_values"].shape == (3, 3, 4, 4)
    assert merged["media_segment_ids"].tolist() == [0, 0, 2]
    assert merged["pixel_values"][2].eq(1).all()


def test_stacked_tiles_internvl_layout_count_images_not_tiles_across_a_batch():
    """Tiles of each image stacked, ``image_num_patches`` per image: the items are the images (one owner each), the
    tiles concatenate in segment order and rows must add up to the counts."""
    a = sample("a", 6, {"pixel_values": torch.zeros(4, 3, 4, 4), "image_num_patches": torch.tensor([1, 3])}, 2,
               (TILED,))
    b = sample("b", 4, {"pixel_values": torch.ones(3, 3, 4, 4), "image_num_patches": torch.tensor([3])}, 1, (TILED,))
    rows = [MLLMPack([a]).to_model_inputs(), MLLMPack([sample("t", 2), b]).to_model_inputs()]
    batch = MLLMCollator(pad_token_id=0)(rows)
    assert batch["pixel_values"].shape == (7, 3, 4, 4) and batch["pixel_values"][4:].eq(1).all()
    assert batch["image_num_patches"].tolist() == [1, 3, 3]
    assert batch["media_segment_ids"].tolist() == [0, 0, 1]
    assert batch["media_batch_index"].tolist() == [0, 0, 1]
    tiles = {"pixel_values": torch.zeros(3, 3, 4, 4), "image_num_patches": torch.tensor([1, 3])}
    with pytest.raises(ValueError, match=r"sample 'bad': .* 3 rows, expected 4 \(the sum of 'image_num_patches'\)"):
        MLLMMediaHandler().merge_pack([sample("bad", 5, tiles, 2, (TILED,))])


def test_a_models_own_field_needs_its_encoders_declaration():
    """The kit knows the generic fields only: an undeclared count field is refused (it would be merged as nothing);
    two samples reading one kind two ways cannot share a pack."""
    tiles = {"pixel_values": torch.zeros(4, 3, 4, 4), "image_num_patches": torch.tensor([1, 3])}
    with pytest.raises(ValueError, match=r"sample 'u': media fields \['image_num_patches'\] are not known"):
        MLLMMediaHandler().merge_pack([sample("u", 6, tiles, 2)])
    stacked = sample("s", 5, {"pixel_values": torch.zeros(1, 3, 4, 4)}, 1)
    with pytest.raises(ValueError, match=r"sample 't': its image fields \['pixel_values', 'image_grid_thw', "
                                         r"'image_num_patches'\] differ from those of sample 's'"):
        MLLMMediaHandler().merge_pack([stacked, sample("t", 6, tiles, 2, (TILED,))])
    truncated = sample("k", 6, tiles, 2, (TILED,)).truncated(6)
    assert MLLMMediaHandler().merge_pack([truncated])["image_num_patches"].tolist() == [1, 3]


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
    with pytest.raises(ValueError, match=r"sample 's': media fields hold 2 items, expected 1"):
        MLLMMediaHandler().merge_pack([stacked])
    other = sample("o", 5, {"images": torch.zeros(1, 3, 4, 4)}, 1)
    with pytest.raises(ValueError, match=r"sample 'o': media fields \['images'\] are not known media fields"):
        MLLMMediaHandler().merge_pack([other])
    grid = torch.tensor([[1, 2, 2]])
    gridded = sample("q", 5, {"pixel_values": torch.zeros(4, 8), "image_grid_thw": grid}, 1)
    good = sample("g", 5, {"pixel_values": torch.zeros(1, 3, 4, 4)}, 1)
    with pytest.raises(ValueError, match=r"sample 'q': media fields \['image_grid_thw', 'pixel_values'\] differ"):
        MLLMMediaHandler().merge_pack([good, gridded])
    no_pixels = sample("n", 5, {"video_grid_thw": grid}, 1)
    with pytest.raises(ValueError, match=r"'video_grid_thw' without 'pixel_values_videos'"):
        MLLMMediaHandler().merge_pack([no_pixels])


def test_images_and_videos_merge_kind_by_kind_in_segment_order():
    """[video, image + video, text, image] in one pack and a video-only pack after it: each kind keeps its items in
    segment order, with its own segment and row ids; num_media counts both kinds."""
    def media(images=(), videos=()):
        out = {}
        if images:
            grid = torch.tensor(images)
            out.update(pixel_values=torch.arange(int(grid.prod(-1).sum())).float()[:, None], image_grid_thw=grid)
        if videos:
            grid = torch.tensor(videos)
            out.update(pixel_values_videos=-torch.arange(int(grid.prod(-1).sum())).float()[:, None],
                       video_grid_thw=grid)
        return out

    v = sample("v", 4, media(videos=[[2, 2, 2]]), 1)
    iv = sample("iv", 6, media(images=[[1, 2, 2]], videos=[[1, 2, 4], [3, 2, 2]]), 3)
    i = sample("i", 3, media(images=[[1, 4, 2]]), 1)
    rows = [MLLMPack([v, iv, sample("t", 2), i]).to_model_inputs(), MLLMPack([v]).to_model_inputs()]
    assert rows[0]["media_segment_ids"].tolist() == [1, 3]
    assert rows[0]["video_segment_ids"].tolist() == [0, 1, 1]
    batch = MLLMCollator(pad_token_id=0)(rows)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 2]]
    assert batch["video_grid_thw"].tolist() == [[2, 2, 2], [1, 2, 4], [3, 2, 2], [2, 2, 2]]
    assert batch["pixel_values"].shape == (12, 1) and batch["pixel_values_videos"].shape == (36, 1)
    assert batch["video_segment_ids"].tolist() == [0, 1, 1, 0] and batch["video_batch_index"].tolist() == [0, 0, 0, 1]
    assert batch["media_segment_ids"].tolist() == [1, 3] and batch["media_batch_index"].tolist() == [0, 0]


def test_per_clip_fields_beside_grids_merge_in_clip_order_and_count_grid_rows():
    """A per-item field of a grid layout (``second_per_grid_ts``: one entry per clip) has one row per grid row, not
    per patch; it concatenates in clip order across packs and rows, and a wrong count is named."""
    def clip(name, grids, seconds):
        grid = torch.tensor(grids)
        media = {"pixel_values_videos": torch.zeros(int(grid.prod(-1).sum()), 1), "video_grid_thw": grid,
                 "second_per_grid_ts": torch.tensor(seconds)}
        return sample(name, 4, media, len(grids), (TIMED,))

    rows = [MLLMPack([clip("a", [[2, 2, 2], [1, 2, 2]], [0.5, 1.0]), sample("t", 2)]).to_model_inputs(),
            MLLMPack([sample("u", 3), clip("b", [[3, 2, 2]], [0.6])]).to_model_inputs()]
    batch = MLLMCollator(pad_token_id=0)(rows)
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([0.5, 1.0, 0.6])
    assert batch["video_segment_ids"].tolist() == [0, 0, 1] and batch["video_batch_index"].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match=r"sample 'bad': media field 'second_per_grid_ts' has 1 rows, expected one "
                                         r"per item \(2\)"):
        MLLMMediaHandler().merge_pack([clip("bad", [[2, 2, 2], [1, 2, 2]], [0.5])])
