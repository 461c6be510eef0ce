"""Qwen2-VL with video: measure == encode under several sampling and size settings, the grids and token counts the
tiny model accepts (packed, several clips per segment), and video faults, overlong clips and changed clips through
the DataKit as the trainer sees them. Packed == one-by-one with a video in the pack is the ``EquivalenceSuite``'s
case (``test_packed_equivalence.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mvp_engine.engine.testing import (
    collate_rows,
    varied_video_records,
    write_broken_videos,
    write_image,
    write_video,
)
from mvp_engine.kit.mllm.data import MLLMDataKit, MLLMDataSpec, MLLMPackingSpec
from recipes.qwen import mm_token_type_ids
from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder
from recipes.qwen2_vl.model import build_model
from recipes.qwen2_vl.packed import prepare_packed

SETTINGS = {  # QwenVideoProcessor fields over the tiny defaults
    "default": {},
    "sparse_small": {"fps": 0.5, "min_frames": 2, "max_frames": 6, "max_pixels": 28 * 28 * 4},
    "dense_large": {"fps": 8.0, "min_frames": 4, "max_frames": 32, "min_pixels": 28 * 28 * 8,
                    "max_pixels": 28 * 28 * 64},
}


@pytest.fixture(scope="module")
def video_records(tmp_path_factory):
    return varied_video_records(tmp_path_factory.mktemp("videos"))


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return build_model(tiny_cfg, "sdpa").eval()


def encoder_with(processor, **settings) -> Qwen2VLSampleEncoder:
    video = dataclasses.replace(processor.video_processor, **settings)
    return Qwen2VLSampleEncoder(dataclasses.replace(processor, video_processor=video))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_measure_equals_encode_and_the_model_takes_the_clips(processor, model, video_records, setting):
    """Every clip's metadata-only count equals its encoded count, and one packed row of all of them runs through
    the tiny model (which checks each clip's placeholder count against its vision features)."""
    encoder = encoder_with(processor, **SETTINGS[setting])
    samples = [encoder.encode(record) for record in video_records]
    for record, sample in zip(video_records, samples):
        assert encoder.measure(record) == sample.meta, record.origin
        video_tokens = int(sample.media["video_grid_thw"].prod(-1).sum()) // encoder.merge_size**2
        assert int((sample.input_ids == encoder.video_token_id).sum()) == video_tokens
    batch = collate_rows([samples], processor.pad_token_id)
    kwargs = prepare_packed(batch, model, "sdpa")
    assert torch.equal(kwargs["video_grid_thw"], torch.cat([s.media["video_grid_thw"] for s in samples]))
    assert kwargs["pixel_values_videos"].shape[0] == int(kwargs["video_grid_thw"].prod(-1).sum())
    with torch.no_grad():
        logits = model(**kwargs).logits
    assert torch.isfinite(logits).all()


def test_token_counts_follow_the_settings(processor, video_records):
    """The 2-second, 15 fps clip: 4 frames (2 pairs) by default, 2 frames sparse, 16 dense; 56x56 frames at most
    4 merged tokens per pair in the small setting."""
    clip = video_records[0]
    counts = {name: encoder_with(processor, **settings).measure(clip) for name, settings in SETTINGS.items()}
    grids = {name: encoder_with(processor, **settings).encode(clip).media["video_grid_thw"].tolist()
             for name, settings in SETTINGS.items()}
    assert grids == {"default": [[2, 4, 4]], "sparse_small": [[1, 4, 4]], "dense_large": [[8, 6, 8]]}
    assert counts["sparse_small"].length < counts["default"].length < counts["dense_large"].length


def test_the_model_refuses_a_clip_with_one_token_short(processor, model, video_records):
    """What the forward test above relies on: a wrong placeholder count is an error, not silence."""
    sample = Qwen2VLSampleEncoder(processor).encode(video_records[0])
    video_token = processor.token_id("<|video_pad|>")
    keep = torch.ones(sample.length, dtype=torch.bool)
    keep[int((sample.input_ids == video_token).nonzero()[0])] = False
    input_ids = sample.input_ids[keep][None]
    with pytest.raises(ValueError, match="Video features and video tokens do not match"), torch.no_grad():
        model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids(input_ids, model.config), use_cache=False,
              **sample.media)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_video_faults_and_overlong_clips_through_the_datakit(processor, tmp_path):
    """LLaVA-Video style records: a missing clip is a read-stage bad record, an unreadable one a measure-stage one,
    a corrupt clip and one shorter than its header promised decode-stage ones (the pack is still served); a clip
    longer than max_seq_len is dropped as overlong (never cut: under truncate too)."""
    broken = write_broken_videos(tmp_path / "broken")
    clip = write_video(tmp_path / "clip.mp4", 8, 48, 64, seed=1)
    long_clip = write_video(tmp_path / "long.mp4", 40, 112, 112, seed=2)
    picture = write_image(tmp_path / "picture.png", 40, 60, seed=3)

    def asks(video=None, **top):
        turn = "<video>\nWhat happens?" if video else "What happens?"
        return {**top, **({"video": video} if video else {}),
                "conversations": [{"from": "human", "value": turn}, {"from": "gpt", "value": "Things move."}]}

    lines = [asks(clip, id="good"), asks(long_clip, id="long"), asks(str(tmp_path / "absent.mp4"), id="missing"),
             *(asks(path, id=reason) for reason, path in broken.items()), asks(id="text"),
             {**asks(id="picture", image=picture), "conversations": [{"from": "human", "value": "<image> What?"},
                                                                     {"from": "gpt", "value": "A picture."}]}]
    source = write_jsonl(tmp_path / "videos.jsonl", lines)
    encoder = Qwen2VLSampleEncoder(processor)
    for overlong in ("drop", "truncate"):
        spec = MLLMDataSpec(sources=[str(source)], max_seq_len=80, overlong=overlong, shuffle=False,
                            cache_dir=str(tmp_path / "cache"), max_bad_fraction=1.0,
                            packing=MLLMPackingSpec(max_seq_len=80, strategy="bfd", buffer_size=100,
                                                    overlong=overlong))
        dataset = MLLMDataKit.build_dataset(spec, encoder)
        reason = "overlong" if overlong == "drop" else "overlong_media_not_truncatable"
        assert dict(dataset.plan(0).drop_counts) == {reason: 1}  # measures first: the report fills
        assert dataset.bad_records.counts("read") == {"missing_video": 1}
        assert dataset.bad_records.counts("measure") == {"unreadable_video": 1}
        packs = [dataset[i] for i in range(len(dataset))]
        decoded = {(bad["record_id"], bad["reason"], bad["stage"]) for pack in packs for bad in pack["bad_records"]}
        assert decoded == {("corrupt_video", "corrupt_video", "decode"),
                           ("video_measure_mismatch", "video_measure_mismatch", "decode")}
        trained = sorted(sample_id for pack in packs for sample_id in pack["sample_ids"])
        assert trained == ["good", "picture", "text"]
        assert sum(len(pack["video_grid_thw"]) for pack in packs if "video_grid_thw" in pack) == 1


def test_a_changed_clip_is_measured_again(processor, tmp_path):
    """The measure cache keys on every media file a record names, videos included."""
    clip = tmp_path / "clip.mp4"
    write_video(clip, 8, 48, 64, seed=1)
    source = write_jsonl(tmp_path / "one.jsonl", [{"video": str(clip), "conversations": [
        {"from": "human", "value": "<video>"}, {"from": "gpt", "value": "Noise."}]}])
    spec = MLLMDataSpec(sources=[str(source)], cache_dir=str(tmp_path / "cache"))
    encoder = Qwen2VLSampleEncoder(processor)
    before = int(MLLMDataKit.build_dataset(spec, encoder).metas.length[0])
    write_video(clip, 40, 48, 64, seed=1)
    after = int(MLLMDataKit.build_dataset(spec, encoder).metas.length[0])
    assert after > before
