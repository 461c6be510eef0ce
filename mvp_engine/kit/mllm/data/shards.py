"""Sharded sources: WebDataset tar shards and folders of parquet / Arrow files, each one ``data.sources`` entry.

Web-scale corpora come as hundreds of shards. A shard source is one entry whose ``path`` is a glob or brace pattern
(``/data/cc/shard-{0000..0999}.tar``, ``/data/cc/*.tar``, expanded by ``webdataset``'s own ``expand_urls`` and then
globbed, in that order), a single ``.tar``, or a folder holding ``.tar``, ``.parquet`` or ``.arrow`` files (one
kind; a folder written by ``save_to_disk`` stays a saved data set). Its records are the shards' records in shard
order, so a plan over it is a plan over (shard, member) ids, and every shard is a unit of its own for the measure
pass (``measure.py``): ranks measure disjoint shares of the shards and cache each shard's table on its own.

**WebDataset tars.** Members are grouped into samples by key, as WebDataset groups them (``base_plus_ext``: the
member name up to the first dot of its last component). A key's ``.json`` member holds the record, in any accepted
format (LLaVA ``conversations``, ShareGPT, OpenAI ``messages``); its ``.jpg`` / ``.jpeg`` / ``.png`` / ``.webp``
(and other image) members and ``.mp4`` / ``.webm`` / ``.mkv`` / ``.avi`` / ``.mov`` members are its media. The
record names a medium by the member's name (``000123.jpg``) or extension (``jpg``) wherever it would name a file
(``image`` / ``images`` / ``video`` / ``videos``, OpenAI parts); a record that names no medium of a kind takes its
key's members of that kind, in member order, as its top-level list (placed by its ``<image>`` / ``<video>`` tags or
at the start of the first user turn, as in a JSON source). A name that is no member of the key is a file path, read
as a JSON source reads it. Media are read in place (``members.py``), never extracted.

Random access needs each member's byte offset, which a streaming reader (``webdataset.WebDataset``) does not keep,
so each shard's index is built here with Python's ``tarfile`` (headers only: the data of every member is skipped
by a seek), once, and kept in the cache (``<cache>/shards``) as an Arrow file keyed by the shard's identity
(``store.file_identity``), as converted JSON files are: one row per key with its origin ``shard.tar#key``, where its
``.json`` member lies and its media members. Bad members are bad records named by that origin: a key without a
``.json`` member (``no_record_member``), a member cut short by the end of the file (``truncated_member``; a shard
whose tail is lost keeps the keys before it), then at measure time invalid JSON (``invalid_json``), a medium that
is neither a member nor a file (``missing_image`` / ``missing_video``), an image whose header does not read
(``unreadable_image``), and while encoding one whose pixels do not decode (``corrupt_image``).

**Parquet and Arrow folders.** Each file is read as a single parquet / saved-Arrow source is (``store.py``): rows are
records, origin ``file#row`` (1-based, per file).
"""

from __future__ import annotations

import functools
import glob
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from filelock import FileLock

from .members import member_path
from .sample import MLLMRecord
from .sources import (
    DEFAULT_MAX_RECORD_BYTES,
    MediaMembers,
    MLLMRecordError,
    decode_json_line,
    parse_record,
    record_too_large,
)

SHARD_INDEX_FORMAT = 1  # bump when the columns of a shard's index change
SHARD_SUFFIXES = {".tar": "webdataset", ".parquet": "parquet_shards", ".arrow": "arrow_shards"}
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"})
VIDEO_EXTENSIONS = frozenset({"mp4", "webm", "mkv", "avi", "mov"})
NO_RECORD_MEMBER = "no_record_member"
TRUNCATED_MEMBER = "truncated_member"
_PATTERN_CHARS = set("*?[{")
_INDEX_SCHEMA = pa.schema([("origin", pa.string()), ("shard", pa.int32()), ("json_offset", pa.int64()),
                           ("json_size", pa.int64()), ("media_names", pa.list_(pa.string())),
                           ("media_offsets", pa.list_(pa.int64())), ("media_sizes", pa.list_(pa.int64())),
                           ("refused", pa.string()), ("refused_reason", pa.string())])


def is_pattern(path: str | os.PathLike) -> bool:
    return bool(_PATTERN_CHARS & set(str(path)))


def shard_files(path: str | os.PathLike) -> tuple[str, list[str]] | None:
    """``(kind, files)`` of a shard source, None when ``path`` is no shard source (a plain file, a saved data set,
    nothing). A pattern that matches nothing, or matches files of several kinds, is an ``invalid_source`` error."""
    text = str(path)
    if is_pattern(text):
        from webdataset.shardlists import expand_urls

        files = list(dict.fromkeys(f for part in expand_urls(text) for f in
                                   (sorted(glob.glob(part)) if is_pattern(part) else [part] if os.path.isfile(part)
                                    else [])))
        if not files:
            raise MLLMRecordError(f"{text}: data source not found (the pattern matches no file)", "invalid_source")
    elif os.path.isdir(text):
        files = sorted(str(f) for f in Path(text).iterdir() if f.is_file() and f.suffix.lower() in SHARD_SUFFIXES)
        if not files:
            return None
    elif text.lower().endswith(".tar"):
        files = [text] if os.path.isfile(text) else []
        if not files:
            return None
    else:
        return None
    kinds = {SHARD_SUFFIXES.get(Path(f).suffix.lower()) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise MLLMRecordError(f"{text}: a shard source holds one kind of shard (.tar, .parquet or .arrow), found "
                              f"{sorted({Path(f).suffix or f for f in files})}", "invalid_source")
    unreadable = next((f for f in files if not os.access(f, os.R_OK)), None)
    if unreadable is not None:
        raise MLLMRecordError(f"{text}: shard {unreadable} is not readable (permissions)", "invalid_source")
    return kinds.pop(), files


# --- the tar index ---------------------------------------------------------------------------------------------


class PreparedIndex(Protocol):
    """An index of a set of tar shards written by the tool that prepared them (``energon.py``), read instead of a
    scan of each shard's headers: ``key(number)`` is what shard ``number``'s rows depend on besides the shard's own
    bytes (the prepared index's identity, the split's excludes), and ``columns(shard, number)`` are its rows
    (:func:`key_columns`)."""

    def key(self, number: int) -> Any: ...

    def columns(self, shard: str, number: int) -> dict[str, list]: ...


def shard_index(shard: str, number: int, cache: Path, identity: str,
                columns: Callable[[str, int], dict[str, list]] | None = None) -> Path:
    """The cached index of one tar shard (built under a file lock, published by rename, as converted JSON is, so an
    index found needs no lock), its rows ``columns(shard, number)``: by default from the shard's own headers."""
    from .store import digest

    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{Path(shard).stem[:40]}-{digest([SHARD_INDEX_FORMAT, identity, number])}.arrow"
    if target.exists():  # published whole by rename: a warm start takes no lock
        return target
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            partial = target.with_suffix(".partial")
            rows = (columns or _index_columns)(shard, number)
            with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, _INDEX_SCHEMA) as writer:
                writer.write_batch(pa.record_batch([pa.array(rows[name], kind) for name, kind in
                                                    zip(_INDEX_SCHEMA.names, _INDEX_SCHEMA.types)],
                                                   schema=_INDEX_SCHEMA))
            os.replace(partial, target)
    return target


def add_member(keys: dict[str, dict[str, Any]], shard: str, key: str, name: str, extension: str, offset: int,
               size: int, shard_size: int) -> None:
    """Member ``name`` (of ``key``, extension ``extension``, ``size`` bytes of data at ``offset``) entered in
    ``keys``, the keys of a shard of ``shard_size`` bytes being indexed: its record, a medium, or why it is refused
    (cut short by the end of the shard); members of other kinds are left out."""
    entry = keys.setdefault(key, {"json": None, "media": [], "refused": None})
    if offset + size > shard_size:
        entry["refused"] = (f"{shard}#{key}: member {name} is cut short ({shard_size - offset} of {size} bytes in the "
                            "shard)", TRUNCATED_MEMBER)
    elif extension.lower() == "json":
        entry["json"] = (offset, size)
    elif extension.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
        entry["media"].append((name, offset, size))


def key_columns(shard: str, number: int, keys: dict[str, dict[str, Any]]) -> dict[str, list]:
    """The index rows of shard ``number`` from its keys (:func:`add_member`), in key order: where each key's record
    and media lie, or why it is refused (a key without a ``.json`` member has no record)."""
    columns: dict[str, list] = {name: [] for name in _INDEX_SCHEMA.names}
    for key, entry in keys.items():
        refused = entry["refused"]
        if refused is None and entry["json"] is None:
            refused = (f"{shard}#{key}: the key has no .json member (its record)", NO_RECORD_MEMBER)
        offset, length = entry["json"] or (0, 0)
        for name, value in (("origin", f"{shard}#{key}"), ("shard", number), ("json_offset", offset),
                            ("json_size", length), ("media_names", [m[0] for m in entry["media"]]),
                            ("media_offsets", [m[1] for m in entry["media"]]),
                            ("media_sizes", [m[2] for m in entry["media"]]),
                            ("refused", refused and refused[0]), ("refused_reason", refused and refused[1])):
            columns[name].append(value)
    return columns


def _index_columns(shard: str, number: int) -> dict[str, list]:
    """One row per key of ``shard``, in member order, from the shard's headers: read directly where every header is
    a plain ustar one (:func:`_plain_members`, a few microseconds a member), else by Python's ``tarfile``."""
    from webdataset.tariterators import base_plus_ext

    size = os.path.getsize(shard)
    keys: dict[str, dict[str, Any]] = {}
    members = _plain_members(shard, size)
    for name, offset, length in members if members is not None else _tarfile_members(shard):
        base, extension = base_plus_ext(name)
        if base is not None:
            add_member(keys, shard, base, name, extension, offset, length, size)
    return key_columns(shard, number, keys)


def _tarfile_members(shard: str) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each file member of ``shard`` by ``tarfile`` (any tar format)."""
    try:
        # "r:" (uncompressed): a member's bytes can then be read at their offset; iterating reads headers only
        tar = tarfile.open(shard, "r:")
    except tarfile.TarError as err:
        raise MLLMRecordError(f"{shard}: not a readable uncompressed tar shard ({err}); remove it from the source "
                              "or repair it", "invalid_source") from None
    with tar:
        try:
            for info in tar:
                if info.isfile():
                    yield info.name, info.offset_data, info.size
        except tarfile.TarError:
            pass  # the shard's tail is lost: the keys before it stand, the one cut short was marked by add_member


_BLOCK = 512
_NUMBERS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))  # mode .. devminor
_FOLDER_TYPES = (b"0", b"\0", b"5")  # file, old-style file (a folder when its name ends in /), folder


def _plain_members(shard: str, size: int) -> list[tuple[str, int, int]] | None:
    """``(name, data offset, size)`` of each file member, read from the headers exactly as ``tarfile`` reads them,
    or None as soon as a header is anything but a plain one (pax, GNU long names, sparse files, links, base-256
    numbers, a bad checksum or field, a header cut short): ``tarfile`` then reads the shard. Why: ``tarfile``'s
    ``TarInfo`` objects cost ~30 us a member, this ~13 us (one seek, one read and a few slices a header), on
    every one of the millions of members a cold start over hundreds of shards indexes."""
    if not size:
        return None  # tarfile's "empty file"
    members: list[tuple[str, int, int]] = []
    offset = 0
    with open(shard, "rb") as handle:
        while offset < size:
            handle.seek(offset)
            header = handle.read(_BLOCK)
            if header.count(0) == _BLOCK:
                break  # the end-of-archive block
            numbers = _header_numbers(header)
            if numbers is None or header[156:157] not in _FOLDER_TYPES:
                return None
            name = _text(header[0:100])
            folder = header[156:157] == b"5" or (header[156:157] == b"\0" and name.endswith("/"))
            prefix = _text(header[345:500])
            if prefix:
                name = prefix + "/" + name
            length = numbers[3]
            if not folder:
                members.append((name, offset + _BLOCK, length))
            offset += _BLOCK + (0 if folder else -(-length // _BLOCK) * _BLOCK)
    return members  # past the end: the last member is cut short (add_member marks it) and nothing follows


def _header_numbers(header: bytes) -> list[int] | None:
    """The numeric fields of a full header whose checksum is right (unsigned or signed sum, its own field counted
    as spaces), each read as ``tarfile.nti`` reads an octal field; None for anything else."""
    if len(header) != _BLOCK:
        return None
    try:
        numbers = [_octal(header[start:end]) for start, end in ((148, 156), *_NUMBERS)]
    except ValueError:
        return None
    unsigned = 256 + sum(header[:148]) + sum(header[156:])
    if numbers[0] != unsigned and numbers[0] != unsigned - 256 * sum(b > 127 for b in header[:148] + header[156:]):
        return None
    return numbers[1:]


def _octal(field: bytes) -> int:
    """An octal header field as ``tarfile.nti`` reads it, or ``ValueError`` (a base-256 number among them, and any
    byte outside ASCII: ``tarfile`` reads those)."""
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _text(field: bytes, encoding: str = tarfile.ENCODING, errors: str = "surrogateescape") -> str:
    """A NUL-terminated header field as ``tarfile`` decodes it."""
    end = field.find(b"\0")
    return (field if end < 0 else field[:end]).decode(encoding, errors)


class _KeyMembers(MediaMembers):
    """The media members of one key, found by member name or extension (``sources.MediaMembers``)."""

    def __init__(self, shard: str, names: list[str], offsets: list[int], sizes: list[int]):
        self.paths = {name: member_path(shard, name, offset, size)
                      for name, offset, size in zip(names, offsets, sizes)}
        self.by_extension = {name.split(".", 1)[-1].lower(): path for name, path in self.paths.items()}

    def find(self, value: str, kind_name: str) -> str | None:
        return self.paths.get(value) or self.by_extension.get(value.lstrip(".").lower())

    def of_kind(self, kind_name: str) -> list[str]:
        """Member names of media of ``kind_name`` (``image`` / ``video``), in member order."""
        extensions = IMAGE_EXTENSIONS if kind_name == "image" else VIDEO_EXTENSIONS
        return [name for name in self.paths if name.rsplit(".", 1)[-1].lower() in extensions]


def _names_media(raw: dict, kind_name: str) -> bool:
    """Whether the record names media of a kind itself: a top-level key, or an OpenAI part with a source."""
    if raw.get(kind_name) is not None or raw.get(f"{kind_name}s") is not None:
        return True
    types = {kind_name, f"{kind_name}_url"}
    return any(isinstance(part, dict) and part.get("type") in types and
               any(part.get(key) is not None for key in ("path", kind_name, f"{kind_name}_url"))
               for turn in raw.get("messages") or [] if isinstance(turn, dict)
               for part in (turn.get("content") if isinstance(turn.get("content"), list) else []))


def with_key_media(raw: Any, members: _KeyMembers) -> Any:
    """``raw`` given its key's media members of each kind it names none of, as its top-level list."""
    if not isinstance(raw, dict):
        return raw
    for kind_name in ("image", "video"):
        names = members.of_kind(kind_name)
        if names and not _names_media(raw, kind_name):
            raw = {**{key: value for key, value in raw.items() if key != kind_name}, f"{kind_name}s": names}
    return raw


@dataclass
class TarShardRows:
    """A WebDataset source's rows (one per key, the index of :func:`shard_index`) and how they become records; the
    ``SourceRows`` interface of ``store.py``. Picklable without the table, for ``datasets.map`` workers."""

    name: str
    image_root: str
    source_dir: str
    shards: tuple[str, ...]
    media_roots: tuple[str, ...] = ()
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def raw_records(self, batch: dict[str, list], indices: list[int]) -> Iterator[tuple[str, Any]]:
        """``(origin, (decoded record, members) or MLLMRecordError)`` per row of a ``datasets`` batch."""
        columns = [batch[name] for name in _INDEX_SCHEMA.names]
        for row in zip(*columns):
            yield row[0], self._raw(dict(zip(_INDEX_SCHEMA.names, row)))

    def _raw(self, row: dict) -> tuple[Any, _KeyMembers] | MLLMRecordError:
        origin = row["origin"]
        if row["refused"] is not None:
            return MLLMRecordError(row["refused"], row["refused_reason"])
        shard = self.shards[row["shard"]]
        if row["json_size"] > self.max_record_bytes:
            return record_too_large(origin, row["json_size"], self.max_record_bytes)
        try:
            with open(shard, "rb") as handle:
                handle.seek(row["json_offset"])
                data = handle.read(row["json_size"])
        except OSError as err:
            return MLLMRecordError(f"{origin}: cannot read the record member: {err}", TRUNCATED_MEMBER)
        raw = decode_json_line(data, origin)
        if isinstance(raw, MLLMRecordError):
            return raw
        members = _KeyMembers(shard, row["media_names"], row["media_offsets"], row["media_sizes"])
        return with_key_media(raw, members), members

    def parse(self, item: Any, origin: str, allow_leading_assistant: bool) -> MLLMRecord:
        raw, members = item
        return parse_record(raw, origin, self.image_root, allow_leading_assistant, source_dir=self.source_dir,
                            media_roots=self.media_roots, members=members)

    def origin(self, table: Any, index: int) -> str:
        return table[index]["origin"]

    def record(self, table: Any, index: int, allow_leading_assistant: bool) -> MLLMRecord:
        row = table[index]
        item = self._raw(row)
        if isinstance(item, MLLMRecordError):
            raise item
        return self.parse(item, row["origin"], allow_leading_assistant)


def open_tar_shards(files: list[str], cache: Path, image_root: str, source_dir: str, media_roots: tuple[str, ...],
                    name: str, max_record_bytes: int,
                    prepared: PreparedIndex | None = None) -> tuple[Any, TarShardRows, list]:
    """The index table of a WebDataset source (its shards' indexes, memory-mapped and concatenated into one
    ``datasets.Dataset``), its rows, and per shard a ``store.Part`` (the measure pass's units). ``prepared``: the
    index the shards were prepared with, read instead of their headers (and part of each shard's identity)."""
    import datasets
    from datasets.table import MemoryMappedTable, concat_tables

    from .store import Part, digest, file_identity

    shards = tuple(os.path.abspath(f) for f in files)
    rows = TarShardRows(name, image_root, source_dir, shards, media_roots, max_record_bytes)
    tables, parts = [], []
    for number, shard in enumerate(shards):
        identity = digest(file_identity(shard))
        if prepared is not None:
            identity = digest([identity, prepared.key(number)])
        index = str(shard_index(shard, number, cache, identity, prepared and prepared.columns))
        tables.append(MemoryMappedTable.from_file(index))
        # one Dataset per shard costs ~10 ms (datasets' fingerprinting): made only for a shard to be measured
        parts.append(Part(rows, identity, len(tables[-1]), functools.partial(datasets.Dataset.from_file, index)))
    # one Dataset over every shard, its fingerprint given (datasets would otherwise hash the table's state)
    table = datasets.Dataset(concat_tables(tables), fingerprint=digest([part.identity for part in parts]))
    return table, rows, parts


@dataclass
class TableShardRows:
    """A folder of parquet / Arrow files as one source: rows are records, origin ``file#row`` per file."""

    name: str
    image_root: str
    source_dir: str
    files: tuple[str, ...]
    starts: tuple[int, ...]  # the first row of each file in the concatenated table, then the total
    media_roots: tuple[str, ...] = ()

    def _locate(self, index: int) -> tuple[int, int]:
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return part, index - self.starts[part]

    def raw_records(self, batch: dict[str, list], indices: list[int]) -> Iterator[tuple[str, Any]]:
        keys = list(batch)
        for j, index in enumerate(indices):
            yield self.origin(None, index), {key: batch[key][j] for key in keys}

    def parse(self, item: Any, origin: str, allow_leading_assistant: bool) -> MLLMRecord:
        return parse_record(item, origin, self.image_root, allow_leading_assistant, source_dir=self.source_dir,
                            media_roots=self.media_roots)

    def origin(self, table: Any, index: int) -> str:
        part, row = self._locate(index)
        return f"{self.files[part]}#{row + 1}"

    def record(self, table: Any, index: int, allow_leading_assistant: bool) -> MLLMRecord:
        return self.parse(table[index], self.origin(table, index), allow_leading_assistant)


def open_table_shards(kind: str, files: list[str], cache: Path, image_root: str, source_dir: str,
                      media_roots: tuple[str, ...], name: str) -> tuple[Any, TableShardRows, list]:
    """A parquet / Arrow folder source: its concatenated table, its rows, and per file its table, rows (a file
    source's, so its origins and its measure cache are the file's own) and identity."""
    import datasets

    from .store import Part, SourceRows, source_identity

    tables, parts = [], []
    for path in files:
        if kind == "parquet_shards":
            table = datasets.Dataset.from_parquet(path, cache_dir=str(cache / "parquet"))
        else:
            table = datasets.Dataset.from_file(path)
        tables.append(table)
        parts.append(Part(SourceRows(path, image_root, source_dir, json_rows=False, media_roots=media_roots),
                          source_identity(path), len(table), lambda table=table: table))
    starts = tuple(np.cumsum([0] + [len(table) for table in tables]).tolist())
    rows = TableShardRows(name, image_root, source_dir, tuple(files), starts, media_roots)
    return datasets.concatenate_datasets(tables), rows, parts
