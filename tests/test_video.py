"""Video in the kit: container metadata without decoding (and the packet-count fallback), frame folders, and every
video fault with its reason. The Qwen families' sampling, sizes, timestamps and patch layout, checked against
transformers' own code, are ``recipes/qwen/tests/test_video.py``."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
from PIL import Image

from mvp_engine.engine.testing import (
    assistant,
    text,
    user,
    video,
    write_broken_videos,
    write_frame_folder,
    write_video,
)
from mvp_engine.kit.mllm.data import (
    MLLMRecord,
    MLLMRecordError,
    load_video_frames,
    read_video_info,
)
from mvp_engine.kit.mllm.data.video import DEFAULT_FRAME_FOLDER_FPS


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("clips")
    return {"h264": write_video(directory / "a.mp4", 12, 48, 64, 0, fps=6),
            "mpeg4": write_video(directory / "b.mp4", 9, 30, 40, 1, fps=3, codec="mpeg4"),
            "webm": write_video(directory / "c.webm", 10, 32, 32, 2, fps=5, codec="libvpx")}


def decoded_frames(path: str) -> int:
    with av.open(path) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.mark.parametrize("name, frames, fps, size", [("h264", 12, 6, (64, 48)), ("mpeg4", 9, 3, (40, 30)),
                                                     ("webm", 10, 5, (32, 32))])
def test_container_metadata_matches_what_decoding_finds(clips, name, frames, fps, size):
    info = read_video_info(clips[name])
    assert (info.num_frames, info.fps, (info.width, info.height)) == (frames, fps, size)
    assert info.num_frames == decoded_frames(clips[name])


def test_webm_states_no_frame_count_so_packets_are_counted(clips):
    with av.open(clips["webm"]) as container:
        assert container.streams.video[0].frames == 0 and container.streams.video[0].duration is None
    assert read_video_info(clips["webm"]).num_frames == 10


def test_metadata_is_read_without_decoding(tmp_path):
    """Clips whose frame data is destroyed or cut measure from their headers; only decoding finds the fault."""
    for reason, path in write_broken_videos(tmp_path).items():
        if reason == "unreadable_video":
            continue
        info = read_video_info(path)
        assert info.num_frames in (12, 20)
        with pytest.raises(MLLMRecordError) as err:
            load_video_frames(info, list(range(0, info.num_frames, 2)))
        assert err.value.reason == reason and str(err.value).startswith(path)


def test_frame_folder_orders_numerically_and_takes_its_fps(tmp_path):
    folder = Path(write_frame_folder(tmp_path / "frames", 11, 20, 30, seed=0))
    (folder / "notes.txt").write_text("not a frame")
    (folder / ".hidden.png").write_bytes(b"")
    info = read_video_info(folder)
    assert [Path(f).name for f in info.frame_files] == [f"frame_{i}.png" for i in range(1, 12)]
    assert (info.num_frames, info.width, info.height, info.fps) == (11, 30, 20, DEFAULT_FRAME_FOLDER_FPS)
    assert read_video_info(folder, fps=0.5).fps == 0.5
    first, last = load_video_frames(info, [0, 10])
    assert first.tobytes() == Image.open(folder / "frame_1.png").convert("RGB").tobytes()
    assert last.tobytes() == Image.open(folder / "frame_11.png").convert("RGB").tobytes()


def test_unreadable_and_missing_videos_fail_at_the_header(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no frames here")
    garbage = write_broken_videos(tmp_path)["unreadable_video"]
    for path, reason in ((tmp_path / "absent.mp4", "missing_video"), (garbage, "unreadable_video"),
                         (empty, "unreadable_video")):
        with pytest.raises(MLLMRecordError) as err:
            read_video_info(path)
        assert err.value.reason == reason and str(err.value).startswith(str(path))


def test_a_recipe_without_video_hooks_refuses_a_clip_as_a_bad_record(tmp_path):
    """LLaVA takes no video: a video record is ``unsupported_video`` at measure (and encode), naming the record."""
    from recipes.llava.encoder import LlavaSampleEncoder
    from recipes.llava.model import build_processor

    clip = write_video(tmp_path / "clip.mp4", 4, 32, 32, seed=0)
    record = MLLMRecord("v", "clips.jsonl:3", [user(video(clip), text("What?")), assistant("Noise.")])
    encoder = LlavaSampleEncoder(build_processor({}))
    for call in (encoder.measure, encoder.encode):
        with pytest.raises(MLLMRecordError, match="^clips.jsonl:3: record 'v': message 0 has a video") as err:
            call(record)
        assert err.value.reason == "unsupported_video"
