"""Sources read in order, without an index: what the stream mode (``data.streaming=true``, ``stream.py``) reads.

A :class:`RecordStream` is a source as a sequence of *units* (the files of a shard list; one for anything else),
each a sequence of rows read in order from any row on. A row's position ``(unit, row)`` is its key within a pass:
the stream mode checkpoints positions, never records, and reads a buffered record again from its position after a
resume. Nothing is measured or converted before the first step:

* ``IterableStream``: any re-iterable of raw records, e.g. a ``datasets.IterableDataset``
  (``load_dataset(..., streaming=True)``) or a generator factory; a resume skips to its position by reading on
  (``islice``), as an iterable allows. Rows of ``datasets`` have ``None`` for the keys other rows have: dropped.
* JSON / JSONL files, read by the kit's own reader (``file:line`` origins, ``data.max_record_bytes``), and
  parquet files, through ``datasets``' streaming reader: both as an ``IterableStream``.
* ``ShardStream``: a shard list (WebDataset tars, parquet / Arrow shards; ``shards.py``), each shard opened when
  the stream reaches it through its cached per-shard index (random access by member), so an endless list costs
  one shard's index at a time.

A row is an :class:`MLLMRecord`, or the :class:`MLLMRecordError` that names why it is bad (counted by the stream,
as the indexed path counts its bad records).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from .measure import default_cache_dir
from .mixture import MLLMSource
from .sample import MLLMRecord
from .shards import shard_files
from .sources import MLLMRecordError, decode_json_line, iter_json_values, jsonl_lines, parse_record
from .spec import MLLMDataSpec
from .store import SHARD_KINDS, RecordStore, source_kind

Row = MLLMRecord | MLLMRecordError
ROWS_PER_BATCH = 256  # rows of a datasets IterableDataset decoded at once


class RecordStream:
    """One source in reading order: ``num_units`` units; ``rows(unit, row)`` yields ``(row, record or error)`` of
    that unit from ``row`` on."""

    name: str
    num_units: int = 1

    def rows(self, unit: int, row: int) -> Iterator[tuple[int, Row]]:
        raise NotImplementedError

    def has_rows(self) -> bool:
        """Whether a pass yields any row: read up to the first one (a stream that starts again at its end would
        otherwise spin on nothing, inside a loader worker)."""
        return any(True for unit in range(self.num_units) for _ in islice(self.rows(unit, 0), 1))


class IterableStream(RecordStream):
    """Raw records from ``raws()`` (a fresh iterator each call: ``(origin or None, raw)``, or bare raw values),
    parsed against the source's media folders. ``None`` origins become ``name#row`` (1-based)."""

    def __init__(self, name: str, raws: Callable[[], Iterable[Any]] | Iterable[Any], image_root: str,
                 source_dir: str | None = None, allow_leading_assistant: bool = False,
                 media_roots: tuple[str, ...] = (), with_origins: bool = False):
        self.name = name
        self.raws = raws if callable(raws) else (lambda: _rows_of(raws))
        self.parse = dict(image_root=image_root, source_dir=source_dir, media_roots=tuple(media_roots),
                          allow_leading_assistant=allow_leading_assistant)
        self.with_origins = with_origins

    def rows(self, unit: int, row: int) -> Iterator[tuple[int, Row]]:
        for index, item in enumerate(islice(self.raws(), row, None), start=row):
            origin, raw = item if self.with_origins else (None, item)
            origin = origin or f"{self.name}#{index + 1}"
            if isinstance(raw, MLLMRecordError):
                yield index, raw
                continue
            try:
                yield index, parse_record(_without_nulls(raw), origin, self.parse["image_root"],
                                          self.parse["allow_leading_assistant"], source_dir=self.parse["source_dir"],
                                          media_roots=self.parse["media_roots"])
            except MLLMRecordError as err:
                yield index, err


class ShardStream(RecordStream):
    """A shard list, one unit per shard, each opened (its per-shard index built once and cached) when reached."""

    def __init__(self, name: str, files: list[str], cache_dir: str | os.PathLike, image_root: str | None,
                 allow_leading_assistant: bool, max_record_bytes: int, media_roots: tuple[str, ...]):
        self.name, self.files, self.num_units = name, files, len(files)
        self.open = dict(cache_dir=cache_dir, image_root=image_root, allow_leading_assistant=allow_leading_assistant,
                         max_record_bytes=max_record_bytes, media_roots=media_roots)
        self._opened: tuple[int, RecordStore] | None = None

    def rows(self, unit: int, row: int) -> Iterator[tuple[int, Row]]:
        if self._opened is None or self._opened[0] != unit:
            self._opened = (unit, RecordStore.open([self.files[unit]], **self.open))
        store = self._opened[1]
        for index in range(row, len(store)):
            try:
                yield index, store[index]
            except MLLMRecordError as err:
                yield index, err


def open_streams(spec: MLLMDataSpec) -> list[RecordStream]:
    """Each entry of ``spec.sources`` as a stream (see the module docstring), one line naming an entry that cannot
    be one."""
    return [open_stream(entry, spec) for entry in spec.source_entries()]


def open_stream(entry: MLLMSource, spec: MLLMDataSpec) -> RecordStream:
    path = Path(entry.path)
    kind = source_kind(path)
    image_root = entry.image_root or spec.image_root
    media_roots = tuple(dict.fromkeys(map(os.path.abspath, spec.media_roots)))
    if kind in SHARD_KINDS:
        return ShardStream(entry.name, shard_files(path)[1], spec.cache_dir or default_cache_dir(), image_root,
                           spec.allow_leading_assistant, spec.max_record_bytes, media_roots)
    folder = os.path.abspath(path.parent)
    root = os.path.abspath(image_root) if image_root is not None else folder
    name, limit = str(path), spec.max_record_bytes
    if kind == "jsonl":
        def raws():
            return ((origin, line if isinstance(line, MLLMRecordError) else decode_json_line(line, origin))
                    for origin, line in jsonl_lines(path, name, limit))
    elif kind == "json":
        def raws():
            return iter_json_values(path, name, limit)
    elif kind == "parquet":
        def raws():
            import datasets

            rows = _rows_of(datasets.load_dataset("parquet", data_files=name, split="train", streaming=True))
            return ((f"{name}#{i + 1}", row) for i, row in enumerate(rows))  # named as the indexed path names them
    else:
        raise MLLMRecordError(f"{path}: a {kind!r} source has an index already: train it without data.streaming "
                              "(stream mode reads JSON, JSONL, parquet files and shard lists)", "invalid_source")
    return IterableStream(entry.name, raws, root, folder, spec.allow_leading_assistant, media_roots,
                          with_origins=True)


def _rows_of(iterable: Iterable[Any]) -> Iterator[Any]:
    """The rows of ``iterable``, all of them in every process: a ``datasets.IterableDataset`` is read through its
    ``iter()``, because its ``__iter__`` inside a DataLoader worker reads only that worker's share of its files
    (and nothing when it has fewer files than workers), while every worker here plans the whole stream."""
    datasets = sys.modules.get("datasets")
    if datasets is None or not isinstance(iterable, datasets.IterableDataset):
        yield from iterable
        return
    for batch in iterable.iter(batch_size=ROWS_PER_BATCH):
        columns = list(batch.items())
        for j in range(len(columns[0][1]) if columns else 0):
            yield {key: values[j] for key, values in columns}


def _without_nulls(raw: Any) -> Any:
    """A ``datasets`` row as the record it was: Arrow gives every row every key of the schema, ``None`` where the
    record had none (a LLaVA row gets ``messages: None``), which the record parser would take for a bad value."""
    if isinstance(raw, dict):
        return {key: _without_nulls(value) for key, value in raw.items() if value is not None}
    if isinstance(raw, list):
        return [_without_nulls(value) for value in raw]
    return raw
