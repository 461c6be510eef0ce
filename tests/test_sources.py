"""Record reading: both formats, every validation error (named by origin), path resolution, image access; videos
(files and frame folders) in every accepted form."""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from mvp_engine.kit.mllm.data.images import load_image, read_image_size
from mvp_engine.kit.mllm.data.sample import MLLMRecord
from mvp_engine.kit.mllm.data.sources import MLLMRecordError, parse_record, read_records


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for name, size in (("a.png", (40, 30)), ("b.png", (20, 50)), ("sub/c.png", (16, 16))):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (200, 10, 10)).save(tmp_path / name)
    (tmp_path / "clip.mp4").write_bytes(b"read checks existence only")
    (tmp_path / "frames").mkdir()
    return tmp_path


def write_jsonl(directory: Path, lines: list, name: str = "data.jsonl") -> Path:
    path = directory / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


def llava(*turns, **top) -> dict:
    return {**top, "conversations": [{"from": f, "value": v} for f, v in turns]}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(path: Path) -> dict:
    return {"type": "image", "path": str(path)}


GOOD = llava(("human", "hi"), ("gpt", "hello"))


def read_failure(path: Path) -> MLLMRecordError:
    with pytest.raises(MLLMRecordError) as info:
        list(read_records(path))
    return info.value


def read_error(path: Path) -> str:
    return str(read_failure(path))


# Every reason a record error may carry (the bad-record report counts records by these).
RECORD_REASONS = {
    "invalid_utf8",
    "invalid_json",
    "invalid_record",
    "missing_image",
    "remote_image",
    "empty_turn",
    "leading_assistant",
    "unplaced_image",
    "conflicting_system",
    "missing_video",
    "remote_video",
    "unplaced_video",
}


# --- validation errors: each names its origin and says what is wrong -----------------------------------------

ERROR_CASES = {
    "invalid_json": ('{"conversations": [', "invalid JSON"),
    "not_object": ([1, 2], "record is not a JSON object (got list)"),
    "neither_format": ({"text": "hi"}, "neither LLaVA style ('conversations') nor OpenAI style ('messages')"),
    "both_formats": ({"conversations": [], "messages": []}, "both 'conversations' (LLaVA) and 'messages'"),
    "unknown_from": (llava(("human", "hi"), ("bot", "hello")), "conversations turn 2: unknown 'from' 'bot'"),
    "unknown_role": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
        "messages turn 2: unknown role 'tool'",
    ),
    "empty_llava": (llava(), "empty conversation"),
    "empty_openai": ({"messages": []}, "empty conversation"),
    "not_ending_with_assistant": (
        llava(("human", "hi"), ("gpt", "hello"), ("human", "bye")),
        "does not end with an assistant turn (last turn is user)",
    ),
    "no_assistant": (llava(("human", "hi")), "no assistant turn"),
    "late_system": (llava(("human", "hi"), ("system", "be nice"), ("gpt", "x")), "only the first turn may be system"),
    "too_many_tags": (
        llava(("human", "<image><image> hi"), ("gpt", "x"), image="a.png"),
        "2 <image> tag(s)/image slot(s) but 1 image(s)",
    ),
    "tag_without_image": (llava(("human", "<image> hi"), ("gpt", "x")), "1 <image> tag(s)/image slot(s) but 0 image"),
    "missing_image": (llava(("human", "<image> hi"), ("gpt", "x"), image="nope.png"), "image file not found: "),
    "non_string_value": (
        llava(("human", 5), ("gpt", "x")),
        "conversations turn 1: 'value' must be a string, got number",
    ),
    "non_string_text_part": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": None}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        "messages turn 1, part 1: text part needs a string 'text', got null",
    ),
    "empty_turn": (llava(("human", "hi"), ("gpt", "")), "turn 2 (assistant) is empty"),
    "whitespace_turn": (llava(("human", "hi"), ("gpt", "   \n")), "turn 2 (assistant) is empty"),
    "whitespace_parts": (
        {
            "messages": [
                {"role": "user", "content": [text(" "), text("\t\n")]},
                {"role": "assistant", "content": "x"},
            ]
        },
        "turn 1 (user) is empty",
    ),
    "leading_assistant": (
        llava(("system", "sys"), ("gpt", "Hello!"), ("human", "hi"), ("gpt", "x")),
        "conversation opens with an assistant turn",
    ),
    "unplaced_llava_image": (
        llava(("human", "<image> hi"), ("gpt", "x"), images=["a.png", "b.png"]),
        "1 of its 2 top-level image(s) have no <image> tag/image slot",
    ),
    "unplaced_openai_image": (
        {
            "images": ["b.png"],
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "a.png"}, text("hi")]},
                {"role": "assistant", "content": "x"},
            ],
        },
        "1 of its 1 top-level image(s) have no <image> tag/image slot",
    ),
    "conflicting_system": (
        llava(("system", "Be brief."), ("human", "hi"), ("gpt", "x"), system="Be verbose."),
        "top-level 'system' 'Be verbose.' differs from the record's own system turn",
    ),
    "non_string_system": (llava(("human", "hi"), ("gpt", "x"), system=["a"]), "'system' must be a string, got list"),
    "remote_url": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        "is a URL; only local files are supported",
    ),
    "missing_video": (llava(("human", "<video> hi"), ("gpt", "x"), video="nope.mp4"),
                      "video file or frame folder not found: "),
    "remote_video": (
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "s3://bucket/v.mp4"}]},
                      {"role": "assistant", "content": "x"}]},
        "video 's3://bucket/v.mp4' is a URL",
    ),
    "unplaced_video": (
        llava(("human", "<video> hi"), ("gpt", "x"), videos=["clip.mp4", "frames"]),
        "1 of its 2 top-level video(s) have no <video> tag/video slot",
    ),
    "too_many_video_tags": (llava(("human", "<video><video>"), ("gpt", "x"), video="clip.mp4"),
                            "2 <video> tag(s)/video slot(s) but 1 video(s)"),
    "video_and_videos": (llava(("human", "hi"), ("gpt", "x"), video="clip.mp4", videos=["frames"]),
                         "both 'video' and 'videos'"),
    "bad_fps": (llava(("human", "<video>"), ("gpt", "x"), video="frames", fps=0), "'fps' must be a positive number"),
    "bad_part_fps": (
        {"messages": [{"role": "user", "content": [{"type": "video", "path": "frames", "fps": "2"}]},
                      {"role": "assistant", "content": "x"}]},
        "part 1: 'fps' must be a positive number, got '2'",
    ),
}


ERROR_REASONS = {
    "invalid_json": "invalid_json",
    "missing_image": "missing_image",
    "remote_url": "remote_image",
    "empty_turn": "empty_turn",
    "whitespace_turn": "empty_turn",
    "whitespace_parts": "empty_turn",
    "leading_assistant": "leading_assistant",
    "unplaced_llava_image": "unplaced_image",
    "unplaced_openai_image": "unplaced_image",
    "conflicting_system": "conflicting_system",
    "missing_video": "missing_video",
    "remote_video": "remote_video",
    "unplaced_video": "unplaced_video",
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_validation_error_names_origin_problem_and_reason(data_dir: Path, case: str) -> None:
    bad, expected = ERROR_CASES[case]
    path = write_jsonl(data_dir, [GOOD, bad, GOOD])
    error = read_failure(path)
    message = str(error)
    assert message.startswith(f"{path}:2: "), message
    assert expected in message, message
    assert error.reason == ERROR_REASONS.get(case, "invalid_record"), (error.reason, message)


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_on_bad_gets_each_bad_record_and_reading_goes_on(data_dir: Path, case: str) -> None:
    bad, _ = ERROR_CASES[case]
    path = write_jsonl(data_dir, [GOOD, bad, {**GOOD, "id": "last"}])
    seen: list[MLLMRecordError] = []
    records = list(read_records(path, on_bad=seen.append))
    assert [r.record_id for r in records] == [f"{path}:1", "last"]
    assert [(str(e).split(": ", 1)[0], e.reason) for e in seen] == [
        (f"{path}:2", ERROR_REASONS.get(case, "invalid_record"))
    ]


MALFORMED = [
    {"conversations": "hi"},
    {"conversations": [5]},
    {"conversations": [{"value": "hi"}]},
    {"conversations": [{"from": "human"}]},
    {"conversations": [{"from": ["human"], "value": "hi"}]},
    {"messages": {"role": "user"}},
    {"messages": [{"content": "hi"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": 3}]},
    {"messages": [{"role": "user", "content": [3]}]},
    {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": {"x": 1}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image_url": {"url": 3}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png", "image": "b.png"}]}]},
    llava(("human", "hi"), ("gpt", "x"), image=3),
    llava(("human", "hi"), ("gpt", "x"), images="a.png"),
    llava(("human", "hi"), ("gpt", "x"), images=[1]),
    llava(("human", "hi"), ("gpt", "x"), image="a.png", images=["a.png"]),
    llava(("human", "hi"), ("gpt", "x"), id=[1]),
    llava(("human", "hi"), ("gpt", "x"), image=""),
]


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_records_raise_record_error_not_bare_errors(data_dir: Path, raw: dict) -> None:
    with pytest.raises(MLLMRecordError, match=r"^rec:7: "):
        parse_record(raw, "rec:7", data_dir)


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(["a.png", "<image>", "human", "x"]))
_keys = st.sampled_from(
    [
        "conversations",
        "messages",
        "from",
        "value",
        "role",
        "content",
        "type",
        "text",
        "image",
        "images",
        "path",
        "image_url",
        "url",
        "id",
    ]
)
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_json)
def test_arbitrary_json_gives_a_record_or_a_record_error(data_dir: Path, raw) -> None:
    try:
        record = parse_record(raw, "rec:1", data_dir)
    except MLLMRecordError as exc:
        assert str(exc).startswith("rec:1: ")
        assert exc.reason in RECORD_REASONS
    else:
        assert isinstance(record, MLLMRecord)


# --- normalisation -----------------------------------------------------------------------------------------------


def test_llava_and_openai_forms_parse_to_the_same_record(data_dir: Path) -> None:
    a, b = data_dir / "a.png", data_dir / "b.png"
    forms = [
        llava(
            ("system", "Be brief."),
            ("human", "<image>\nCompare with <image>, please."),
            ("gpt", "Same."),
            ("human", "Sure?"),
            ("gpt", "Yes."),
            id="r1",
            images=["a.png", "b.png"],
        ),
        {
            "id": "r1",
            "images": ["a.png", "b.png"],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>\nCompare with <image>, please."},
                {"role": "assistant", "content": "Same."},
                {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "Yes."},
            ],
        },
        {
            "id": "r1",
            "messages": [
                {"role": "system", "content": [text("Be brief.")]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "a.png"},
                        text("\nCompare"),
                        text(" with "),
                        {"type": "image_url", "image_url": {"url": f"file://{b}"}},
                        text(", please."),
                    ],
                },
                {"role": "assistant", "content": [text("Same.")]},
                {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": [text("Yes.")]},
            ],
        },
        {
            "id": "r1",
            "images": ["a.png", "b.png"],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "image"}, text("\nCompare with "), {"type": "image"}, text(", please.")],
                },
                {"role": "assistant", "content": "Same."},
                {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "Yes."},
            ],
        },
    ]
    records = list(read_records(write_jsonl(data_dir, forms)))
    expected = [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [image(a), text("\nCompare with "), image(b), text(", please.")]},
        {"role": "assistant", "content": [text("Same.")]},
        {"role": "user", "content": [text("Sure?")]},
        {"role": "assistant", "content": [text("Yes.")]},
    ]
    for record in records:
        assert record.record_id == "r1"
        assert record.messages == expected
        assert record.image_paths == [str(a), str(b)]


def test_images_without_tags_go_to_the_start_of_the_first_user_turn(data_dir: Path) -> None:
    raw = llava(
        ("system", "sys"),
        ("human", "What is it?"),
        ("gpt", "A."),
        ("human", "And?"),
        ("gpt", "B."),
        images=["a.png", "b.png"],
    )
    record = parse_record(raw, "rec:1", data_dir)
    assert record.messages[0] == {"role": "system", "content": [text("sys")]}
    assert record.messages[1]["content"] == [image(data_dir / "a.png"), image(data_dir / "b.png"), text("What is it?")]


def video(path: Path, **fps) -> dict:
    return {"type": "video", "path": str(path), **fps}


def test_video_forms_parse_to_the_same_record(data_dir: Path) -> None:
    """LLaVA-Video top-level videos with ``<video>`` tags, OpenAI video parts (path, ``video``, ``video_url``, a
    slot), a frame folder: one record, each video where it was put, the record's fps on those without their own."""
    clip, frames = data_dir / "clip.mp4", data_dir / "frames"
    question = [{"type": "image", "image": "a.png"}, text("\nFirst "), None, text(" then "), None, text("?")]

    def openai(first: dict, second: dict, **top) -> dict:
        parts = [first if p is None and i == 2 else second if p is None else p for i, p in enumerate(question)]
        return {**top, "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "x"}]}

    forms = [
        llava(("human", "<image>\nFirst <video> then <video>?"), ("gpt", "x"), image="a.png",
              videos=["clip.mp4", "frames"], fps=3),
        openai({"type": "video", "video": "clip.mp4"}, {"type": "video", "path": str(frames)}, fps=3),
        openai({"type": "video_url", "video_url": {"url": f"file://{clip}"}, "fps": 3}, {"type": "video", "fps": 3},
               videos=["frames"], fps=1),
    ]
    expected = [image(data_dir / "a.png"), text("\nFirst "), video(clip, fps=3.0), text(" then "),
                video(frames, fps=3.0), text("?")]
    for raw in forms:
        record = parse_record(raw, "rec:1", data_dir)
        assert record.messages[0]["content"] == expected
        assert record.video_paths == [str(clip), str(frames)]
        assert record.media_paths == [str(data_dir / "a.png"), str(clip), str(frames)]


def test_unplaced_videos_go_first_after_unplaced_images_and_without_fps(data_dir: Path) -> None:
    raw = llava(("human", "What?"), ("gpt", "x"), image="a.png", video="clip.mp4")
    record = parse_record(raw, "rec:1", data_dir)
    assert record.messages[0]["content"] == [image(data_dir / "a.png"), video(data_dir / "clip.mp4"), text("What?")]


def test_tag_positions_and_text_are_kept_exactly(data_dir: Path) -> None:
    raw = llava(("human", "A <image> B\n<image>"), ("gpt", " x "), images=["a.png", "b.png"])
    record = parse_record(raw, "rec:1", data_dir)
    a, b = data_dir / "a.png", data_dir / "b.png"
    assert record.messages[0]["content"] == [text("A "), image(a), text(" B\n"), image(b)]
    assert record.messages[1]["content"] == [text(" x ")]


def test_leading_assistant_is_trained_when_allowed(data_dir: Path) -> None:
    raw = llava(("gpt", "Welcome!"), ("human", "hi"), ("gpt", "x"))
    with pytest.raises(MLLMRecordError, match="^rec:1: conversation opens with an assistant turn") as info:
        parse_record(raw, "rec:1", data_dir)
    assert info.value.reason == "leading_assistant"
    record = parse_record(raw, "rec:1", data_dir, allow_leading_assistant=True)
    assert [m["role"] for m in record.messages] == ["assistant", "user", "assistant"]
    path = write_jsonl(data_dir, [raw, GOOD])
    assert len(list(read_records(path, allow_leading_assistant=True))) == 2
    seen: list[MLLMRecordError] = []
    assert len(list(read_records(path, on_bad=seen.append))) == 1
    assert [e.reason for e in seen] == ["leading_assistant"]


@pytest.mark.parametrize("fmt", ["llava", "openai"])
def test_top_level_system_becomes_the_leading_system_turn(data_dir: Path, fmt: str) -> None:
    def make(system_turn: str | None = None, **top) -> dict:
        turns = [("system", system_turn)] if system_turn is not None else []
        turns += [("human", "hi"), ("gpt", "x")]
        if fmt == "llava":
            return llava(*turns, **top)
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        return {**top, "messages": [{"role": roles[f], "content": v} for f, v in turns]}

    expected = [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [text("hi")]},
        {"role": "assistant", "content": [text("x")]},
    ]
    assert parse_record(make(system="Be brief."), "rec:1", data_dir).messages == expected
    assert parse_record(make("Be brief.", system="Be brief."), "rec:1", data_dir).messages == expected
    assert parse_record(make(system=""), "rec:1", data_dir).messages == expected[1:]  # "" means no system prompt
    assert parse_record(make("Be brief.", system=" "), "rec:1", data_dir).messages == expected
    with pytest.raises(MLLMRecordError, match="^rec:1: top-level 'system'") as info:
        parse_record(make("Be brief.", system="Be brief. "), "rec:1", data_dir)
    assert info.value.reason == "conflicting_system"
    with pytest.raises(MLLMRecordError, match="^rec:1: 'system' must be a string") as info:
        parse_record(make(system=3), "rec:1", data_dir)
    assert info.value.reason == "invalid_record"


def test_whitespace_is_kept_in_turns_that_are_not_blank(data_dir: Path) -> None:
    raw = llava(("human", "<image>\n"), ("gpt", "\n ok \n"), image="a.png")
    record = parse_record(raw, "rec:1", data_dir)
    assert record.messages[0]["content"] == [image(data_dir / "a.png"), text("\n")]
    assert record.messages[1]["content"] == [text("\n ok \n")]


def test_placed_images_and_unplaced_ones(data_dir: Path) -> None:
    a, b = data_dir / "a.png", data_dir / "b.png"
    raw = {
        "images": ["b.png"],
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, text("and"), {"type": "image"}]},
            {"role": "assistant", "content": "x"},
        ],
    }
    record = parse_record(raw, "rec:1", data_dir)
    assert record.messages[0]["content"] == [image(a), text("and"), image(b)]
    raw = llava(("human", "<image> A"), ("gpt", "x"), ("human", "B"), ("gpt", "y"), images=["a.png", "b.png", "b.png"])
    with pytest.raises(MLLMRecordError, match=r"^rec:1: .*2 of its 3 top-level image\(s\)") as info:
        parse_record(raw, "rec:1", data_dir)
    assert info.value.reason == "unplaced_image"
    assert str(b) in str(info.value)


def test_record_id_defaults_to_origin_and_accepts_integers(data_dir: Path) -> None:
    path = write_jsonl(data_dir, [GOOD, {**GOOD, "id": 42}])
    first, second = read_records(path)
    assert first.record_id == f"{path}:1" == first.origin
    assert second.record_id == "42"


def test_relative_image_paths_resolve_against_data_dir_or_image_root(data_dir: Path, tmp_path_factory) -> None:
    raw = llava(("human", "<image>"), ("gpt", "x"), image="sub/../sub/./c.png")
    (record,) = read_records(write_jsonl(data_dir, [raw]))
    assert record.image_paths == [str(data_dir / "sub" / "c.png")]
    assert os.path.isabs(record.image_paths[0])

    elsewhere = tmp_path_factory.mktemp("elsewhere")
    raw = llava(("human", "<image>"), ("gpt", "x"), image="sub/c.png")
    (record,) = read_records(write_jsonl(elsewhere, [raw]), image_root=data_dir)
    assert record.image_paths == [str(data_dir / "sub" / "c.png")]

    raw = llava(("human", "<image>"), ("gpt", "x"), image=str(data_dir / "a.png"))  # absolute, inside the root
    (record,) = read_records(write_jsonl(elsewhere, [raw], "abs.jsonl"), image_root=data_dir)
    assert record.image_paths == [str(data_dir / "a.png")]


@pytest.fixture
def outside(tmp_path_factory) -> Path:
    """A folder beside the data with an image and a clip that no record of the data may reach."""
    folder = tmp_path_factory.mktemp("outside")
    Image.new("RGB", (8, 8)).save(folder / "secret.png")
    (folder / "clip.mp4").write_bytes(b"x")
    return folder


def escapes(data_dir: Path, outside: Path) -> dict[str, dict]:
    """Every way a record can name a file outside its image root and source folder, by the reason it must get."""
    (data_dir / "link.png").symlink_to(outside / "secret.png")
    (data_dir / "linked").symlink_to(outside, target_is_directory=True)
    up = os.path.relpath(outside / "secret.png", data_dir)
    image_part = {"type": "image", "path": up}
    video_part = {"type": "video_url", "video_url": {"url": f"file://{outside / 'clip.mp4'}"}}
    return {
        "relative ..": llava(("human", "<image>"), ("gpt", "x"), image=up),
        "absolute": llava(("human", "<image>"), ("gpt", "x"), image=str(outside / "secret.png")),
        "file url": llava(("human", "<image>"), ("gpt", "x"), image=f"file://{outside / 'secret.png'}"),
        "symlinked file": llava(("human", "<image>"), ("gpt", "x"), image="link.png"),
        "symlinked folder": llava(("human", "<image>"), ("gpt", "x"), images=["a.png", "linked/secret.png"]),
        "openai part": {"messages": [{"role": "user", "content": [image_part]}, {"role": "assistant", "content": "x"}]},
        "missing, outside": llava(("human", "<image>"), ("gpt", "x"), image="../../nope.png"),
        "video": {"messages": [{"role": "user", "content": [video_part]}, {"role": "assistant", "content": "x"}]},
    }


def test_media_paths_that_leave_the_image_root_and_the_source_folder_are_bad_records(data_dir, outside) -> None:
    cases = escapes(data_dir, outside)
    path = write_jsonl(data_dir, [GOOD, *cases.values()])
    seen: list[MLLMRecordError] = []
    records = list(read_records(path, on_bad=seen.append))
    assert [r.origin for r in records] == [f"{path}:1"]
    reasons = {case: (str(e).split(": ", 1)[0], e.reason) for case, e in zip(cases, seen, strict=True)}
    assert reasons == {case: (f"{path}:{line}", "video_outside_root" if case == "video" else "image_outside_root")
                       for line, case in enumerate(cases, start=2)}
    assert all("outside the image root, the source's folder and data.media_roots" in str(e) for e in seen)


def test_media_may_lie_under_the_image_root_or_the_source_folder_through_symlinks_that_stay_inside(
        data_dir, outside, tmp_path_factory) -> None:
    (data_dir / "alias.png").symlink_to(data_dir / "sub" / "c.png")
    images = tmp_path_factory.mktemp("images")
    Image.new("RGB", (8, 8)).save(images / "own.png")
    raw = llava(("human", "<image><image><image>"), ("gpt", "x"),
                images=["own.png", str(data_dir / "a.png"), str(data_dir / "alias.png")])
    (record,) = read_records(write_jsonl(data_dir, [raw]), image_root=images)
    assert record.image_paths == [str(images / "own.png"), str(data_dir / "a.png"), str(data_dir / "alias.png")]
    with pytest.raises(MLLMRecordError) as info:  # the source's folder is no licence for the image root's parent
        parse_record(llava(("human", "<image>"), ("gpt", "x"), image="../outside/secret.png"), "r:1", images,
                     source_dir=data_dir)
    assert info.value.reason == "image_outside_root"


def test_a_media_folder_linked_to_shared_storage_is_refused_until_data_media_roots_holds_it(data_dir, outside) -> None:
    """The common LLaVA layout: ``playground/data/coco`` links to shared storage, so every image really lies
    outside the image root; the person running the data says the storage is theirs with ``data.media_roots``."""
    (data_dir / "coco").symlink_to(outside, target_is_directory=True)
    path = write_jsonl(data_dir, [llava(("human", "<image>"), ("gpt", "x"), image="coco/secret.png")])
    err = read_failure(path)
    assert err.reason == "image_outside_root"
    assert str(err).endswith(f"outside the image root, the source's folder and data.media_roots "
                             f"({os.path.realpath(data_dir)}); "
                             "not opened: add its folder to data.media_roots if it is yours")
    for root in (outside, data_dir / "coco"):  # a root counts by its real path, as the media do
        (record,) = read_records(path, media_roots=[str(root)])
        assert record.image_paths == [str(data_dir / "coco" / "secret.png")]
    with pytest.raises(MLLMRecordError) as info:  # a media root opens its own folder, not its parent
        parse_record(llava(("human", "<image>"), ("gpt", "x"), image=str(outside.parent / "beside.png")), "r:1",
                     data_dir, media_roots=[str(outside)])
    assert info.value.reason == "image_outside_root"


# --- files -------------------------------------------------------------------------------------------------------


def test_jsonl_skips_blank_lines_and_keeps_real_line_numbers(data_dir: Path) -> None:
    path = write_jsonl(data_dir, [GOOD, "", "   ", GOOD])
    assert [r.origin for r in read_records(path)] == [f"{path}:1", f"{path}:4"]


def test_json_list_origins_are_start_lines(data_dir: Path) -> None:
    path = data_dir / "data.json"
    path.write_text(json.dumps([GOOD, {**GOOD, "id": "two"}], indent=2), encoding="utf-8")
    records = list(read_records(path))
    assert [r.record_id for r in records] == [f"{path}:2", "two"]
    starts = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if line == "  {"]
    assert [r.origin for r in records] == [f"{path}:{n}" for n in starts]


def test_minified_json_origins_carry_the_record_index(data_dir: Path) -> None:
    path = data_dir / "data.json"
    path.write_text(json.dumps([GOOD, GOOD, llava(("human", "hi"))]), encoding="utf-8")
    assert read_error(path).startswith(f"{path}:1#3: no assistant turn")


def test_json_file_errors(data_dir: Path) -> None:
    path = data_dir / "data.json"
    path.write_text(json.dumps(GOOD), encoding="utf-8")
    error = read_failure(path)
    assert str(error) == f"{path}:1: a .json data file must hold a list of records, got object"
    assert error.reason == "invalid_source"
    path.write_text('[\n{"conversations": []},\n{"conversations": [}\n]', encoding="utf-8")
    assert read_error(path).startswith(f"{path}:3: invalid JSON")
    path.write_text(f"[{json.dumps(GOOD)}]\n[]", encoding="utf-8")
    assert read_error(path).startswith(f"{path}:2: invalid JSON: extra data")
    path.write_text("[]", encoding="utf-8")
    assert list(read_records(path)) == []


def test_malformed_json_document_is_raised_even_with_on_bad(data_dir: Path) -> None:
    path = data_dir / "data.json"
    seen: list[MLLMRecordError] = []
    for document, line in (('[\n{"conversations": []},\n{"conversations": [}\n]', 3), (f"[{json.dumps(GOOD)}]\n[]", 2)):
        path.write_text(document, encoding="utf-8")
        with pytest.raises(MLLMRecordError, match=f"^{re.escape(str(path))}:{line}: invalid JSON") as info:
            list(read_records(path, on_bad=seen.append))
        assert info.value.reason == "invalid_json"
    path.write_bytes(b"[\xff]")
    with pytest.raises(MLLMRecordError, match="file is not valid UTF-8") as info:
        list(read_records(path, on_bad=seen.append))
    assert info.value.reason == "invalid_utf8"
    assert seen == []


def test_json_list_element_that_fails_goes_to_on_bad(data_dir: Path) -> None:
    path = data_dir / "data.json"
    bad = llava(("human", "hi"), id=7)
    path.write_text(json.dumps([GOOD, bad, {**GOOD, "id": "three"}], indent=2), encoding="utf-8")
    seen: list[MLLMRecordError] = []
    records = list(read_records(path, on_bad=seen.append))
    assert [r.record_id for r in records] == [f"{path}:2", "three"]
    (error,) = seen
    assert str(error).startswith(f"{path}:") and "no assistant turn" in str(error)
    assert (error.reason, error.record_id) == ("invalid_record", "7")


def test_jsonl_bad_lines_go_to_on_bad_and_the_good_ones_are_read(data_dir: Path) -> None:
    path = data_dir / "mixed.jsonl"
    lines = [
        json.dumps(GOOD).encode(),
        b'{"conversations": [',
        b"\xff\xfe",
        b"",
        json.dumps(llava(("human", "hi"), ("gpt", " "), id="blank-answer")).encode(),
        json.dumps({**GOOD, "id": 5}).encode(),
        json.dumps(llava(("human", "<image>"), ("gpt", "x"), id=9, image="gone.png")).encode(),
        json.dumps(GOOD).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    seen: list[MLLMRecordError] = []
    records = list(read_records(path, on_bad=seen.append))
    assert [r.origin for r in records] == [f"{path}:1", f"{path}:6", f"{path}:8"]
    assert [(str(e).split(": ", 1)[0], e.reason, e.record_id) for e in seen] == [
        (f"{path}:2", "invalid_json", None),
        (f"{path}:3", "invalid_utf8", None),
        (f"{path}:5", "empty_turn", "blank-answer"),
        (f"{path}:7", "missing_image", "9"),
    ]
    with pytest.raises(MLLMRecordError, match=f"^{re.escape(str(path))}:2: invalid JSON"):
        list(read_records(path))  # without on_bad the first bad record stops the reading


def test_a_jsonl_line_over_max_record_bytes_is_a_bad_record_skipped_without_holding_it(data_dir: Path) -> None:
    path = data_dir / "big.jsonl"
    huge = json.dumps(llava(("human", "x" * 8 * 2**20), ("gpt", "y"))).encode()
    limit = len(json.dumps(GOOD)) + 1
    path.write_bytes(b"\n".join([json.dumps(GOOD).encode(), huge, b"", json.dumps(GOOD).encode()]) + b"\n")
    seen: list[MLLMRecordError] = []
    tracemalloc.start()
    try:
        records = list(read_records(path, on_bad=seen.append, max_record_bytes=limit))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20  # the 8 MiB line was never held whole
    assert [r.origin for r in records] == [f"{path}:1", f"{path}:4"]
    (error,) = seen
    assert (error.reason, str(error)) == ("record_too_large", f"{path}:2: record is {len(huge)} bytes, over "
                                          f"data.max_record_bytes={limit}; not read (raise the limit to train it)")


def test_a_json_record_over_max_record_bytes_is_a_bad_record(data_dir: Path) -> None:
    path = data_dir / "data.json"
    big = llava(("human", "x" * 300), ("gpt", "y"), id="big")
    path.write_text(json.dumps([GOOD, big, GOOD], indent=1), encoding="utf-8")
    seen: list[MLLMRecordError] = []
    assert len(list(read_records(path, on_bad=seen.append, max_record_bytes=200))) == 2
    assert [(str(e).split(": ", 1)[0].rsplit(":", 1)[0], e.reason) for e in seen] == [(str(path), "record_too_large")]
    assert len(list(read_records(path))) == 3  # the default limit (16 MiB) takes it


def test_record_error_carries_the_record_id_when_there_is_one(data_dir: Path) -> None:
    with pytest.raises(MLLMRecordError) as info:
        parse_record(llava(("human", "hi"), id="r-1"), "rec:1", data_dir)
    assert info.value.record_id == "r-1"
    with pytest.raises(MLLMRecordError) as info:
        parse_record(llava(("human", "hi")), "rec:1", data_dir)
    assert info.value.record_id is None
    with pytest.raises(MLLMRecordError) as info:
        parse_record(llava(("human", "hi"), ("gpt", "x"), id=[1]), "rec:1", data_dir)
    assert (info.value.reason, info.value.record_id) == ("invalid_record", None)
    assert MLLMRecordError("x: y", record_id="k").record_id == "k"


def test_file_level_errors(data_dir: Path) -> None:
    missing = read_failure(data_dir / "missing.jsonl")
    assert str(missing) == f"{data_dir / 'missing.jsonl'}: data file not found"
    (data_dir / "data.csv").write_text("x")
    csv = read_failure(data_dir / "data.csv")
    assert "unsupported file type '.csv'" in str(csv)
    assert missing.reason == csv.reason == "invalid_source"
    seen: list[MLLMRecordError] = []
    with pytest.raises(MLLMRecordError, match="data file not found"):
        list(read_records(data_dir / "missing.jsonl", on_bad=seen.append))  # a config error, not a bad record
    assert seen == []
    bad = data_dir / "bad.jsonl"
    bad.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    error = read_failure(bad)
    assert str(error).startswith(f"{bad}:2: line is not valid UTF-8")
    assert error.reason == "invalid_utf8"


# --- images ------------------------------------------------------------------------------------------------------


def test_read_image_size_reads_the_header_only(data_dir: Path, monkeypatch) -> None:
    jpeg = data_dir / "photo.jpg"
    exif = Image.Exif()
    exif[0x0112] = 1
    Image.new("RGB", (33, 21)).save(jpeg, exif=exif)

    def no_decoding(self):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert read_image_size(data_dir / "a.png") == (40, 30)
    assert read_image_size(jpeg) == (33, 21)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_size_and_loaded_image_agree_under_exif_rotation(tmp_path: Path, orientation: int) -> None:
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.new("RGB", (48, 16), (0, 0, 255)).save(path, exif=exif)
    loaded = load_image(path)
    assert read_image_size(path) == loaded.size
    assert loaded.size == ((16, 48) if orientation >= 5 else (48, 16))


def test_load_image_is_rgb_loaded_closed_and_composites_alpha(tmp_path: Path) -> None:
    path = tmp_path / "alpha.png"
    Image.new("RGBA", (8, 6), (0, 0, 0, 0)).save(path)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    loaded = load_image(path)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
    path.unlink()
    assert loaded.mode == "RGB" and loaded.size == (8, 6)
    assert loaded.getpixel((3, 3)) == (255, 255, 255)
    gray = tmp_path / "gray.png"
    Image.new("L", (5, 5), 7).save(gray)
    assert load_image(gray).getpixel((0, 0)) == (7, 7, 7)


def test_unreadable_images_raise_errors_naming_the_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    for reader in (read_image_size, load_image):
        with pytest.raises(MLLMRecordError, match=f"^{re.escape(str(junk))}: cannot"):
            reader(junk)
        with pytest.raises(MLLMRecordError, match="missing.png: cannot"):
            reader(tmp_path / "missing.png")
    truncated = tmp_path / "truncated.png"
    Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "full.png")
    truncated.write_bytes((tmp_path / "full.png").read_bytes()[:200])
    assert read_image_size(truncated) == (64, 64)  # the header is intact...
    with pytest.raises(MLLMRecordError, match=f"^{re.escape(str(truncated))}: cannot load image"):
        load_image(truncated)  # ...the pixels are not
