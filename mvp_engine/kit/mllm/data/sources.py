"""Reading training records from JSON / JSONL files into :class:`MLLMRecord`, model-free.

Two record formats are accepted, detected per record, so one file may mix them:

* **LLaVA style** — ``{"id"?, "image": str | "images": [str], "conversations": [{"from", "value"}, ...]}``
  with ``from`` in ``human``/``gpt``/``system`` (``user``/``assistant`` are accepted as aliases). ``<image>``
  tags in the text mark where the images go, in order.
* **OpenAI style** — ``{"id"?, "messages": [{"role", "content"}, ...], "images"?: [str]}`` with ``role`` in
  ``system``/``user``/``assistant``. ``content`` is a string or a list of parts: ``{"type": "text", "text"}``
  or ``{"type": "image", "image" | "path" | "image_url": ...}`` (also ``{"type": "image_url", "image_url":
  {"url": ...}}``); ``image_url`` may be a string or ``{"url": str}``, ``file://`` URLs are accepted, remote
  ones are not (training must not depend on the network). A ``<image>`` tag in text, or an image part without
  a source, takes the next path from the top-level ``images`` list.

Videos, in either format, mirror images: a top-level ``"video": str`` or ``"videos": [str]`` (LLaVA-Video style)
placed by ``<video>`` tags, and OpenAI parts ``{"type": "video", "video" | "path" | "video_url": ...}`` (also
``{"type": "video_url", "video_url": {"url": ...}}``; a part without a source takes the next top-level video). A
video is a file any FFmpeg demuxer reads (through PyAV) or a **frame folder**: a directory whose image files,
sorted by name (numbers compared as numbers), are the frames. A frame folder has no frame rate of its own: it is
the part's ``"fps"``, else the record's top-level ``"fps"``, else ``DEFAULT_FRAME_FOLDER_FPS`` of
``mvp_engine/kit/mllm/data/video.py`` (a video file's container rate always wins over a given ``fps``).

Normalisation (what every encoder can rely on):

* Image parts sit exactly where their tag or part was; the text around them is kept byte for byte (the
  ``"\\n"`` after a LLaVA ``<image>`` tag stays, as LLaVA-style pipelines keep it). Adjacent text parts are
  joined (chat templates concatenate parts without a separator, so this changes nothing rendered) and empty
  text parts are dropped, so equivalent content in either format yields the same record.
* A top-level ``"system"`` string (the ShareGPT / LLaMA-Factory convention), in either format, becomes a leading
  system turn; an empty or whitespace-only one means no system prompt, as those datasets write it. A record that
  also has its own system turn keeps one when the two are identical and is a bad record otherwise.
* A record that has images but no ``<image>`` tag / image slot / image part at all follows the LLaVA convention:
  all its images go, in order, at the start of the first user turn. A record that places some images but leaves
  a top-level image without a slot is a bad record (the image would land where its author did not put it).
  Videos follow the same rules with ``<video>`` tags, on their own: unplaced videos go to the start of the first
  user turn after any unplaced images.
* A turn holding only whitespace text (and no image) is as empty as ``""`` and makes a bad record; text that is
  not blank is never stripped.
* The first turn after the system prompt must be a user turn (a leading assistant turn trains an answer to
  nothing), unless ``allow_leading_assistant`` is set.
* Relative image and video paths are resolved against ``image_root`` (default: the data file's directory) and
  made absolute; every image file, video file or frame folder must exist. A video part keeps its ``"fps"`` (a
  positive number) when the record gives one.
* Media stay inside the data: a path, relative or absolute, whose real location (``..`` and every symlink
  resolved) is under none of ``image_root``, the source's own folder and the ``media_roots`` (``data.media_roots``,
  for every source) is a bad record (``image_outside_root`` / ``video_outside_root``), never opened. A record is
  text written by whoever made the data set, so ``../../etc/passwd`` or ``/home/me/.ssh/id_rsa`` must not become a
  training image; a symlink is resolved too, because a downloaded archive can carry one. Media kept elsewhere need
  an ``image_root`` (per source, or ``data.image_root``) that holds them, or their real folder in ``media_roots``:
  the common LLaVA layout links ``playground/data/coco`` to shared storage, where every image really lies outside
  the image root, and only the person running the training can say that storage is theirs.
* ``record_id`` is the record's ``id`` (string or integer) or, without one, its origin.

Every problem is an :class:`MLLMRecordError` whose message starts with the record's origin (``file:line``),
so a bad record in a million-line file can be found at once; no bare ``KeyError``/``TypeError`` escapes. Its
``reason`` names the fault class and ``record_id`` the record's ``id`` when it has one. In a ``.json`` file the
origin line is the line where the record starts; when several records start on the same line (minified JSON),
``#N`` (1-based record index) is appended.

Real datasets carry broken records, so :func:`read_records` takes ``on_bad``: each bad record (a line that is
not UTF-8 or not JSON, a record over ``max_record_bytes``, or a record :func:`parse_record` refuses) goes to it and
reading goes on with the next record; without ``on_bad`` the first one is raised. A JSONL line over the limit is
skipped while the file is scanned, never held whole: measuring one 50 MB line (tokenizing it) took 7 GB of memory.
A ``.json`` document that does not parse cannot be resynced and is always raised, as are file-level problems
(reason ``invalid_source``: a config error, not a bad record).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mvp_engine.kit.mllm.data.sample import MLLMRecord

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
DEFAULT_MAX_RECORD_BYTES = 16 * 2**20  # data.max_record_bytes: a record of 16 MiB is far past any real one
RECORD_TOO_LARGE = "record_too_large"
_SKIP_CHUNK = 2**20  # bytes read at a time while skipping the rest of a line over the limit


@dataclass(frozen=True)
class _Kind:
    """A media kind as records write it: its name (also its top-level keys, ``name`` and ``name + "s"``), text tag,
    OpenAI part types, the part keys naming a file, and whether a folder is one (a video's frame folder)."""

    name: str
    tag: str
    part_types: tuple[str, ...]
    source_keys: tuple[str, ...]
    url_key: str
    folders: bool

    def exists(self, path: str) -> bool:
        return os.path.isfile(path) or (self.folders and os.path.isdir(path))


IMAGE = _Kind("image", IMAGE_TAG, ("image", "image_url"), ("path", "image", "image_url"), "image_url", False)
VIDEO = _Kind("video", VIDEO_TAG, ("video", "video_url"), ("path", "video", "video_url"), "video_url", True)
_KINDS = (IMAGE, VIDEO)
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(kind.tag) for kind in _KINDS) + ")")

_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class _Slot:
    """Marks a medium whose path comes from the top-level list of its kind (a tag, or a part without a source);
    ``fps`` is a video part's own frame rate."""

    kind: _Kind
    fps: float | None = None


class MLLMRecordError(ValueError):
    """A training record (or a file or image it names) that cannot be used; the message starts with its origin.

    ``reason`` is the fault class the bad-record report counts it under (documented with every other reason in
    ``skills/kit/mllm-data-kit/references/bad_records.md``); ``record_id`` is the record's own ``id`` when it has
    a usable one (None otherwise), so the report can name the record as its owner knows it.
    """

    def __init__(self, message: str, reason: str = "invalid_record", *, record_id: str | None = None,
                 media_path: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.record_id = record_id
        # the file (or frame folder) a ``missing_*`` / ``*_outside_root`` verdict names: its change (appearing, a
        # symlink pointed elsewhere) changes the verdict, so the measure cache watches it
        self.media_path = media_path


def read_records(
    path: str | os.PathLike,
    image_root: str | os.PathLike | None = None,
    *,
    allow_leading_assistant: bool = False,
    on_bad: Callable[[MLLMRecordError], None] | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    media_roots: tuple[str, ...] | list[str] = (),
) -> Iterator[MLLMRecord]:
    """Yield the records of a ``.json`` (list of records) or ``.jsonl`` (one per line) file, validated.

    Lazy for JSONL (one line at a time, so huge files stream); a ``.json`` file is parsed whole, as JSON
    requires. Blank JSONL lines are skipped. A bad record goes to ``on_bad`` and reading continues; without
    ``on_bad`` it is raised. ``media_roots``: further folders media may lie in (see :func:`parse_record`).
    """
    path = Path(path)
    name = str(path)
    root = os.path.abspath(image_root if image_root is not None else path.parent)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise MLLMRecordError(
            f"{name}: unsupported file type {path.suffix!r} (expected .json or .jsonl)", "invalid_source"
        )
    if not path.is_file():
        raise MLLMRecordError(f"{name}: data file not found", "invalid_source")
    if suffix == ".jsonl":
        raw_records = ((origin, decode_json_line(line, origin) if isinstance(line, bytes) else line)
                       for origin, line in jsonl_lines(path, name, max_record_bytes))
    else:
        raw_records = iter_json_values(path, name, max_record_bytes)
    for origin, raw in raw_records:
        try:
            if isinstance(raw, MLLMRecordError):
                raise raw
            record = parse_record(raw, origin, root, allow_leading_assistant, source_dir=path.parent,
                                  media_roots=media_roots)
        except MLLMRecordError as err:
            _bad(err, on_bad)
            continue
        yield record


def parse_record(
    raw: Any, origin: str, image_root: str | os.PathLike, allow_leading_assistant: bool = False,
    source_dir: str | os.PathLike | None = None, media_roots: tuple[str, ...] | list[str] = (),
    members: MediaMembers | None = None,
) -> MLLMRecord:
    """Validate one decoded JSON value and normalise it to an :class:`MLLMRecord` (see module docstring).

    Media paths resolve against ``image_root`` and must lie under it, under ``source_dir`` (the folder holding
    the source; None: ``image_root`` alone) or under one of ``media_roots`` (``data.media_roots``). ``members``:
    the media a record of a tar shard may name by member (``shards.py``), tried before the files. The error
    carries the record's ``id`` when it has a usable one, so a report can name the record.
    """
    folders = (os.path.abspath(image_root), os.path.abspath(source_dir or image_root),
               *map(os.path.abspath, media_roots))
    roots = _MediaRoots(folders[0], tuple(dict.fromkeys(map(_real_folder, folders))), members)
    try:
        return _parse_record(raw, origin, roots, allow_leading_assistant)
    except MLLMRecordError as err:
        if err.record_id is None:
            err.record_id = _given_id(raw)
        raise


def _parse_record(raw: Any, origin: str, roots: _MediaRoots, allow_leading_assistant: bool) -> MLLMRecord:
    if not isinstance(raw, dict):
        raise MLLMRecordError(f"{origin}: record is not a JSON object (got {_json_type(raw)})")
    has_llava, has_openai = "conversations" in raw, "messages" in raw
    if has_llava and has_openai:
        raise MLLMRecordError(f"{origin}: record has both 'conversations' (LLaVA) and 'messages' (OpenAI)")
    if not (has_llava or has_openai):
        raise MLLMRecordError(
            f"{origin}: record is neither LLaVA style ('conversations') nor OpenAI style ('messages'); "
            f"keys: {sorted(raw)}"
        )
    fps = _fps(raw.get("fps"), origin)
    media = {kind: [roots.resolve(p, origin, kind) for p in _top_level(raw, origin, kind)] for kind in _KINDS}
    messages = _llava_messages(raw, origin) if has_llava else _openai_messages(raw, origin, roots, fps)
    messages = _with_top_level_system(raw, messages, origin)
    _check_roles(messages, origin, allow_leading_assistant)
    for kind in reversed(_KINDS):  # unplaced media are prepended: videos first, so images end up before them
        _fill_slots(messages, kind, media[kind], fps, origin)
    messages = [{"role": m["role"], "content": _merge_text(m["content"])} for m in messages]
    for index, message in enumerate(messages, start=1):
        if all(part["type"] == "text" and not part["text"].strip() for part in message["content"]):
            raise MLLMRecordError(f"{origin}: turn {index} ({message['role']}) is empty", "empty_turn")
    return MLLMRecord(record_id=_record_id(raw, origin), origin=origin, messages=messages)


# --- files -------------------------------------------------------------------------------------------------


def _bad(err: MLLMRecordError, on_bad: Callable[[MLLMRecordError], None] | None) -> None:
    """Hand a bad record to ``on_bad`` so reading can go on, or raise it when there is none."""
    if on_bad is None:
        raise err from None
    on_bad(err)


def jsonl_lines(path: Path, name: str, max_bytes: int = DEFAULT_MAX_RECORD_BYTES
                ) -> Iterator[tuple[str, bytes | MLLMRecordError]]:
    """``(origin, line)`` of every line of a JSONL file that is not blank, origin ``name:line`` (1-based): the one
    numbering of JSONL records, for the in-memory reader and the record store alike. A line longer than
    ``max_bytes`` (its newline not counted) comes as its :func:`record_too_large` error instead, read in chunks and
    dropped, so it never sits whole in memory."""
    with path.open("rb") as handle:
        line_no = 0
        while line := handle.readline(max_bytes + 1):
            line_no += 1
            origin = f"{name}:{line_no}"
            size = len(line) - line.endswith(b"\n")
            if size <= max_bytes:
                if line.strip():
                    yield origin, line
                continue
            while not line.endswith(b"\n") and (line := handle.readline(_SKIP_CHUNK)):
                size += len(line) - line.endswith(b"\n")
            yield origin, record_too_large(origin, size, max_bytes)


def record_too_large(origin: str, size: int, max_bytes: int) -> MLLMRecordError:
    """The bad record of a record of ``size`` bytes, over the ``data.max_record_bytes`` limit."""
    return MLLMRecordError(f"{origin}: record is {size} bytes, over data.max_record_bytes={max_bytes}; not read "
                           "(raise the limit to train it)", RECORD_TOO_LARGE)


def decode_json_line(line: bytes, origin: str) -> Any:
    """The JSON value of one JSONL line, or the :class:`MLLMRecordError` it is (returned, not raised: the caller
    decides whether a bad record stops anything)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return MLLMRecordError(f"{origin}: line is not valid UTF-8 ({exc})", "invalid_utf8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return MLLMRecordError(f"{origin}: invalid JSON: {exc.msg} (column {exc.colno})", "invalid_json")


def iter_json_values(path: Path, name: str, max_bytes: int = DEFAULT_MAX_RECORD_BYTES
                     ) -> Iterator[tuple[str, Any]]:
    """Decode a JSON list element by element so each record knows the line it starts on; a record whose text is
    longer than ``max_bytes`` comes as its :func:`record_too_large` error (the document is parsed whole, as JSON
    requires, but nothing measures the record)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MLLMRecordError(f"{name}: file is not valid UTF-8 ({exc})", "invalid_utf8") from None
    decoder = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")

    def skip(pos: int) -> int:
        return ws.match(text, pos).end()

    def fail(pos: int, what: str) -> MLLMRecordError:
        line = text.count("\n", 0, pos) + 1
        return MLLMRecordError(f"{name}:{line}: invalid JSON: {what}", "invalid_json")

    pos = skip(0)
    if pos >= len(text) or text[pos] != "[":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _json_error(name, exc) from None
        raise MLLMRecordError(
            f"{name}:1: a .json data file must hold a list of records, got {_json_type(value)}", "invalid_source"
        )
    starts: list[tuple[int, Any]] = []  # (offset, value, or _Oversized for a record over the limit)
    pos = skip(pos + 1)
    if pos < len(text) and text[pos] == "]":
        pos = skip(pos + 1)
    else:
        while True:
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise _json_error(name, exc) from None
            # a character is 1 to 4 UTF-8 bytes: count the bytes only where the characters leave it open
            size = len(text[pos:end].encode("utf-8")) if 4 * (end - pos) > max_bytes else end - pos
            starts.append((pos, value if size <= max_bytes else _Oversized(size)))
            pos = skip(end)
            if pos < len(text) and text[pos] == ",":
                pos = skip(pos + 1)
                continue
            if pos < len(text) and text[pos] == "]":
                pos = skip(pos + 1)
                break
            raise fail(pos, "expected ',' or ']' after a record")
    if pos != len(text):
        raise fail(pos, "extra data after the list of records")
    lines, line, last = [], 1, 0
    for start, _ in starts:
        line += text.count("\n", last, start)
        last = start
        lines.append(line)
    shared = {ln for i, ln in enumerate(lines) if i and lines[i - 1] == ln}
    for index, ((_, value), ln) in enumerate(zip(starts, lines, strict=True), start=1):
        origin = f"{name}:{ln}#{index}" if ln in shared else f"{name}:{ln}"
        yield origin, record_too_large(origin, value.size, max_bytes) if isinstance(value, _Oversized) else value


@dataclass(frozen=True)
class _Oversized:
    """Stands for a ``.json`` record over the size limit until its origin is known (the value itself is let go)."""

    size: int


def _json_error(name: str, exc: json.JSONDecodeError) -> MLLMRecordError:
    return MLLMRecordError(f"{name}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})", "invalid_json")


# --- formats -----------------------------------------------------------------------------------------------


def _turns(raw: dict, list_key: str, role_key: str, content_key: str, roles: dict, expected: str, origin: str):
    """Validated ``(where, role, content)`` of each turn of ``raw[list_key]``; both formats share this shape."""
    turns = raw[list_key]
    if not isinstance(turns, list):
        raise MLLMRecordError(f"{origin}: {list_key!r} must be a list, got {_json_type(turns)}")
    for index, turn in enumerate(turns, start=1):
        where = f"{origin}: {list_key} turn {index}"
        if not isinstance(turn, dict):
            raise MLLMRecordError(f"{where} is not an object (got {_json_type(turn)})")
        if role_key not in turn:
            raise MLLMRecordError(f"{where} has no {role_key!r}")
        role = turn[role_key]
        if not isinstance(role, str) or role not in roles:
            label = "'from'" if role_key == "from" else "role"
            raise MLLMRecordError(f"{where}: unknown {label} {role!r} (expected {expected})")
        if content_key not in turn:
            raise MLLMRecordError(f"{where} has no {content_key!r}")
        yield where, roles[role], turn[content_key]


def _llava_messages(raw: dict, origin: str) -> list[dict]:
    messages = []
    for where, role, value in _turns(raw, "conversations", "from", "value", _LLAVA_ROLES, "human, gpt or system",
                                     origin):
        if not isinstance(value, str):
            raise MLLMRecordError(f"{where}: 'value' must be a string, got {_json_type(value)}")
        messages.append({"role": role, "content": _split_tags(value)})
    return messages


def _openai_messages(raw: dict, origin: str, roots: _MediaRoots, fps: float | None) -> list[dict]:
    messages = []
    for where, role, content in _turns(raw, "messages", "role", "content", _OPENAI_ROLES,
                                       "system, user or assistant", origin):
        if isinstance(content, str):
            parts = _split_tags(content)
        elif isinstance(content, list):
            parts = []
            for part_index, part in enumerate(content, start=1):
                parts.extend(_openai_part(part, f"{where}, part {part_index}", roots, fps))
        else:
            raise MLLMRecordError(f"{where}: 'content' must be a string or a list of parts, got {_json_type(content)}")
        messages.append({"role": role, "content": parts})
    return messages


def _openai_part(part: Any, where: str, roots: _MediaRoots, record_fps: float | None) -> list:
    if not isinstance(part, dict):
        raise MLLMRecordError(f"{where} is not an object (got {_json_type(part)})")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise MLLMRecordError(f"{where}: text part needs a string 'text', got {_json_type(text)}")
        return _split_tags(text)
    media = next((media for media in _KINDS if kind in media.part_types), None)
    if media is None:
        raise MLLMRecordError(f"{where}: unsupported content part type {kind!r} (expected 'text', 'image' or "
                              "'video')")
    fps = (_fps(part.get("fps"), where) or record_fps) if media is VIDEO else None
    sources = [key for key in media.source_keys if part.get(key) is not None]
    if not sources:
        return [_Slot(media, fps)]
    if len(sources) > 1:
        raise MLLMRecordError(f"{where}: {media.name} part has several sources {sources}; give one")
    value = part[sources[0]]
    if isinstance(value, dict) and sources[0] == media.url_key:
        value = value.get("url")
    if not isinstance(value, str):
        raise MLLMRecordError(f"{where}: {media.name} {sources[0]!r} must be a path string, got {_json_type(value)}")
    return [_media_part(media, roots.resolve(value, where, media), fps)]


# --- validation and normalisation --------------------------------------------------------------------------


def _with_top_level_system(raw: dict, messages: list[dict], origin: str) -> list[dict]:
    """``messages`` led by the record's top-level ``system`` string, read as a system turn would be."""
    system = raw.get("system")
    if system is None:
        return messages
    if not isinstance(system, str):
        raise MLLMRecordError(f"{origin}: 'system' must be a string, got {_json_type(system)}")
    if not system.strip():
        return messages
    parts = _split_tags(system)
    if messages and messages[0]["role"] == "system":
        if _merge_text(messages[0]["content"]) != _merge_text(parts):
            raise MLLMRecordError(
                f"{origin}: top-level 'system' {system[:80]!r} differs from the record's own system turn; "
                "give one system prompt",
                "conflicting_system",
            )
        return messages
    return [{"role": "system", "content": parts}, *messages]


def _check_roles(messages: list[dict], origin: str, allow_leading_assistant: bool) -> None:
    if not messages:
        raise MLLMRecordError(f"{origin}: empty conversation")
    for index, message in enumerate(messages[1:], start=2):
        if message["role"] == "system":
            raise MLLMRecordError(f"{origin}: turn {index} is a system turn; only the first turn may be system")
    if not any(m["role"] == "assistant" for m in messages):
        raise MLLMRecordError(f"{origin}: no assistant turn, nothing to train on")
    if messages[-1]["role"] != "assistant":
        raise MLLMRecordError(
            f"{origin}: conversation does not end with an assistant turn (last turn is {messages[-1]['role']})"
        )
    if not any(m["role"] == "user" for m in messages):
        raise MLLMRecordError(f"{origin}: no user turn")
    first = next(m for m in messages if m["role"] != "system")
    if first["role"] == "assistant" and not allow_leading_assistant:
        raise MLLMRecordError(
            f"{origin}: conversation opens with an assistant turn (set allow_leading_assistant to train on it)",
            "leading_assistant",
        )


def _fill_slots(messages: list[dict], kind: _Kind, paths: list[str], fps: float | None, origin: str) -> None:
    """Put the top-level media of ``kind`` into their slots, or at the start of the first user turn if none of
    them is placed; ``fps`` is the record's frame rate, for video slots without their own."""

    def is_slot(part) -> bool:
        return isinstance(part, _Slot) and part.kind is kind

    slots = sum(1 for m in messages for part in m["content"] if is_slot(part))
    placed = slots or any(not isinstance(part, _Slot) and part["type"] == kind.name
                          for m in messages for part in m["content"])
    if not placed and paths:
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"] = [_Slot(kind)] * len(paths) + first_user["content"]
        slots = len(paths)
    name = kind.name
    if slots < len(paths):
        raise MLLMRecordError(
            f"{origin}: the record places {name}s but {len(paths) - slots} of its {len(paths)} top-level {name}(s) "
            f"have no {kind.tag} tag/{name} slot: {paths[slots:]}",
            f"unplaced_{name}",
        )
    if slots > len(paths):
        raise MLLMRecordError(f"{origin}: {slots} {kind.tag} tag(s)/{name} slot(s) but {len(paths)} {name}(s) in the "
                              "record")
    queue = iter(paths)
    for message in messages:
        message["content"] = [_media_part(kind, next(queue), part.fps or fps) if is_slot(part) else part
                              for part in message["content"]]


def _media_part(kind: _Kind, path: str, fps: float | None) -> dict:
    """A normalised media part; only a video keeps a frame rate."""
    part = {"type": kind.name, "path": path}
    return {**part, "fps": fps} if fps is not None and kind is VIDEO else part


def _split_tags(text: str) -> list:
    parts: list = []
    for piece in _TAG_SPLIT.split(text):
        kind = next((kind for kind in _KINDS if piece == kind.tag), None)
        if kind is not None:
            parts.append(_Slot(kind))
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _merge_text(parts: list) -> list:
    """Adjacent text parts joined, empty ones dropped; image parts and slots kept in place."""
    merged: list = []
    for part in parts:
        if not isinstance(part, _Slot) and part["type"] == "text":
            if not part["text"]:
                continue
            if merged and not isinstance(merged[-1], _Slot) and merged[-1]["type"] == "text":
                merged[-1] = {"type": "text", "text": merged[-1]["text"] + part["text"]}
                continue
        merged.append(part)
    return merged


def _top_level(raw: dict, origin: str, kind: _Kind) -> list[str]:
    """The record's top-level paths of ``kind`` (``"image"``: str or ``"images"``: [str]; videos alike)."""
    one, many = kind.name, f"{kind.name}s"
    if one in raw and many in raw:
        raise MLLMRecordError(f"{origin}: record has both {one!r} and {many!r}; use one")
    if one in raw:
        value = raw[one]
        if value is None:
            return []
        if not isinstance(value, str):
            raise MLLMRecordError(f"{origin}: {one!r} must be a path string, got {_json_type(value)}")
        return [value]
    value = raw.get(many)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise MLLMRecordError(f"{origin}: {many!r} must be a list of path strings")
    return list(value)


def _fps(value: Any, where: str) -> float | None:
    """A given frame rate as a float (None when not given); anything but a positive finite number is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise MLLMRecordError(f"{where}: 'fps' must be a positive number, got {value!r}")
    return float(value)


class MediaMembers:
    """Media a record may name without a file of their own (the members of its key in a tar shard): ``find`` gives
    the path string of the member a reference names, or None when it names none (then it is a file path)."""

    def find(self, value: str, kind_name: str) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class _MediaRoots:
    """Where a record's media may come from: relative paths join ``base``; every path must really lie (symlinks
    resolved) under one of ``allowed`` (real paths: the image root, the source's folder, ``data.media_roots``);
    ``members``: media named by member, looked up first."""

    base: str
    allowed: tuple[str, ...]
    members: MediaMembers | None = None

    def resolve(self, value: str, where: str, kind: _Kind) -> str:
        """Absolute path of a media reference, checked to stay inside the allowed folders and to exist; ``where``
        prefixes the error message."""
        name = kind.name
        member = self.members.find(value, name) if self.members is not None else None
        if member is not None:
            return member
        if value.startswith("file://"):
            value = value[len("file://") :]
        elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", value) and not re.match(r"^[A-Za-z]:[\\/]", value):
            raise MLLMRecordError(f"{where}: {name} {value[:80]!r} is a URL; only local files are supported",
                                  f"remote_{name}")
        if not value:
            raise MLLMRecordError(f"{where}: empty {name} path")
        path = os.path.abspath(os.path.join(self.base, value))
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, folder]) == folder for folder in self.allowed):
            raise MLLMRecordError(f"{where}: {name} {value[:80]!r} leads to {real}, outside the image root, the "
                                  f"source's folder and data.media_roots ({', '.join(self.allowed)}); not opened: "
                                  "add its folder to data.media_roots if it is yours", f"{name}_outside_root",
                                  media_path=path)
        if not kind.exists(path):
            what = "image file" if kind is IMAGE else "video file or frame folder"
            raise MLLMRecordError(f"{where}: {what} not found: {path}", f"missing_{name}", media_path=path)
        return path


@functools.lru_cache(maxsize=256)
def _real_folder(folder: str) -> str:
    """The real path of an absolute folder, once per process (every record of a source asks for the same ones)."""
    return os.path.realpath(folder)


def _record_id(raw: dict, origin: str) -> str:
    value = _given_id(raw)
    if value is None and raw.get("id") is not None:
        raise MLLMRecordError(f"{origin}: 'id' must be a string or an integer, got {_json_type(raw['id'])}")
    return origin if value is None else value


def _given_id(raw: Any) -> str | None:
    """The record's usable ``id`` (a string or an integer) as a string, else None."""
    value = raw.get("id") if isinstance(raw, dict) else None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return str(value)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
