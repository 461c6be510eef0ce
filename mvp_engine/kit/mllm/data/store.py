"""Records in memory-mapped Arrow tables instead of Python objects: ten million records cost disk, not RAM.

Sources (``data.sources``, one file or folder each):

* ``.jsonl`` / ``.json``: converted once into an Arrow file in the cache (``<cache>/records``), one row per record
  holding its origin (``file:line``, numbered by ``jsonl_lines`` as :func:`read_records` numbers it) and its raw
  JSON text. ``datasets``' own JSON loader is not used for this: it keeps no line numbers and fails a whole file on
  one malformed line, while a bad line here is one bad record, found when the record is measured. A record over
  ``data.max_record_bytes`` is a row without its text (``refused`` says why: a bad record when measured). The Arrow
  file is keyed by the file's identity (:func:`source_identity`) and the size limit, so an edited file is converted
  again.
* ``.parquet``: loaded with ``datasets.Dataset.from_parquet`` (its own fingerprinted Arrow cache); origin
  ``file#row`` (1-based).
* a folder written by ``datasets``' ``save_to_disk``: loaded with ``Dataset.load_from_disk`` (memory-mapped as it
  is); origin ``folder#row``. A ``DatasetDict`` folder gives its ``train`` split, or its only split.

* a shard source: WebDataset tar shards by pattern or folder, an Energon-prepared folder (its ``train`` split part,
  ``energon.py``), or a folder / pattern of parquet or Arrow files (``shards.py``): one source whose shards are
  indexed, measured and cached one by one (``RecordStore.parts``).

:func:`source_kind` says which of these a path is (or why it is none), before anything is read: the run's config
check asks it, so a path training could not open stops the run at once, as one line naming it.

Rows of parquet and saved data sets are records in either accepted format (LLaVA ``conversations`` or OpenAI
``messages``), with image paths as strings. Relative image paths resolve against the source's own ``image_root`` (a
``data.sources`` mapping), else ``data.image_root``, else the folder holding the source; media may lie there, in the
source's folder or under ``data.media_roots``. Parsing and validation are the kit's :func:`parse_record`, run when a
record is measured and again when it is encoded, so a store holds bytes, not Python objects. A converted JSON file
does not depend on the media settings (they decide verdicts, which the measure cache keys on).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from filelock import FileLock

from .energon import energon_index, is_energon_folder
from .sample import MLLMRecord
from .shards import is_pattern, open_table_shards, open_tar_shards, shard_files
from .sources import (
    DEFAULT_MAX_RECORD_BYTES,
    RECORD_TOO_LARGE,
    MLLMRecordError,
    decode_json_line,
    iter_json_values,
    jsonl_lines,
    parse_record,
)

STORE_FORMAT = 2  # bump when the Arrow layout of converted JSON sources changes (2: the ``refused`` column)
_ROWS_PER_BATCH = 50_000
_SCHEMA = pa.schema([("origin", pa.string()), ("raw", pa.binary()), ("refused", pa.string())])
EDGE_BYTES = 64 * 1024  # bytes of each end of a file hashed into its identity
SHARD_KINDS = ("webdataset", "parquet_shards", "arrow_shards")  # shard lists (an Energon folder has its own index)


def file_identity(path: str | os.PathLike) -> list:
    """What says a file is unchanged: its absolute path, its :func:`content_identity` and its status-change time
    (ns).

    Size and mtime alone miss a file rewritten at the same size with its mtime kept (``cp -p``, ``rsync -a``, tar
    extraction, ``touch -r``), which then trained the lengths measured for the old content. Every such rewrite
    sets the ctime, which no user call can set back; the edge hash covers file systems whose ctime is not real (some
    FUSE and object-store mounts). The inode is left out: it changes when such a mount is mounted again, which would
    measure a whole data set again for nothing. A metadata change (``chmod``) also moves the ctime: the price is one
    measure, never a stale length."""
    return [os.path.abspath(path), *content_identity(path), os.stat(path).st_ctime_ns]


def content_identity(path: str | os.PathLike) -> list:
    """What a faithful copy of a file keeps (``rsync -a``, ``cp -p``, staging to a node's disk): its size, its
    modification time (ns) and a hash of its first and last ``EDGE_BYTES`` (the whole of a small file). A run's
    resume check keys on this, where a stale length cannot happen but a spurious refusal would block the user."""
    stat = os.stat(path)
    with open(path, "rb") as handle:
        edges = hashlib.sha256(handle.read(EDGE_BYTES))
        if stat.st_size > 2 * EDGE_BYTES:
            handle.seek(-EDGE_BYTES, os.SEEK_END)
        edges.update(handle.read(EDGE_BYTES))
    return [stat.st_size, stat.st_mtime_ns, edges.hexdigest()[:24]]


def source_identity(path: str | os.PathLike) -> str:
    """What a source's content is, as a short hash: the :func:`file_identity` of its file, or of every file of a
    ``save_to_disk`` folder. It keys the converted records and the measured lengths; a run's record of the data it
    trained can keep it to notice a changed source."""
    path = Path(path)
    if path.is_dir():
        folder = _saved_folder(path)
        return digest([str(folder.resolve()), [file_identity(f) for f in sorted(folder.iterdir()) if f.is_file()]])
    return digest(file_identity(path))


def digest(value: Any) -> str:
    """A stable short hash of a JSON-able value (cache keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class Part:
    """One unit of a source that is measured and cached on its own: the source itself, or one shard of a shard
    source. ``table()`` makes its ``datasets.Dataset``, only when it must be measured: a warm start of thousands of
    shards reads their cached measures and never pays for a ``Dataset`` per shard."""

    rows: Any  # the part's SourceRows (or a shard source's own rows object)
    identity: str
    num_rows: int
    table: Callable[[], Any]


@dataclass
class SourceRows:
    """One source as a ``datasets.Dataset`` plus how its rows become raw records; picklable without the table, so
    ``datasets.map`` workers can take it. ``json_rows``: rows are ``(origin, raw JSON bytes, refused)``.
    ``source_dir``: the folder holding the source, where media may lie besides ``image_root``; ``media_roots``: the
    further folders they may lie in (``data.media_roots``, absolute)."""

    name: str
    image_root: str
    source_dir: str
    json_rows: bool
    media_roots: tuple[str, ...] = ()

    def raw_records(self, batch: dict[str, list], indices: list[int]) -> Iterator[tuple[str, Any]]:
        """``(origin, decoded record or MLLMRecordError)`` per row of a ``datasets`` batch."""
        if self.json_rows:
            for origin, raw, refused in zip(batch["origin"], batch["raw"], batch["refused"]):
                yield origin, _json_row(origin, raw, refused)
            return
        keys = list(batch)
        for j, index in enumerate(indices):
            yield f"{self.name}#{index + 1}", {key: batch[key][j] for key in keys}

    def origin(self, table: Any, index: int) -> str:
        return table[index]["origin"] if self.json_rows else f"{self.name}#{index + 1}"

    def parse(self, item: Any, origin: str, allow_leading_assistant: bool) -> MLLMRecord:
        """A decoded record of :meth:`raw_records` parsed and validated (raises :class:`MLLMRecordError`)."""
        return parse_record(item, origin, self.image_root, allow_leading_assistant, source_dir=self.source_dir,
                            media_roots=self.media_roots)

    def record(self, table: Any, index: int, allow_leading_assistant: bool) -> MLLMRecord:
        """Row ``index`` parsed and validated (raises :class:`MLLMRecordError` for a bad one)."""
        row = table[index]
        if self.json_rows:
            origin, raw = row["origin"], _json_row(row["origin"], row["raw"], row["refused"])
            if isinstance(raw, MLLMRecordError):
                raise raw
        else:
            origin, raw = f"{self.name}#{index + 1}", row
        return self.parse(raw, origin, allow_leading_assistant)


def _json_row(origin: str, raw: bytes, refused: str | None) -> Any:
    """The decoded record of a converted JSON row, or the :class:`MLLMRecordError` it is."""
    return MLLMRecordError(refused, RECORD_TOO_LARGE) if refused is not None else decode_json_line(raw, origin)


class RecordStore:
    """Every record of the sources, by index, read from memory-mapped Arrow tables.

    ``store[i]`` parses record ``i`` on demand; ``len(store)`` counts every record row (bad ones included, as the
    bad-record fraction counts them). ``sources`` pairs each table with its :class:`SourceRows`; ``fingerprints``
    says what each source's content is (:func:`source_identity`), for the measure cache, as does
    ``max_record_bytes`` (the JSON rows it left without their text). ``parts``: per source, the units it is
    measured and cached in (:class:`Part`): the source itself, or each shard of a shard source (``shards.py``), in
    row order.
    """

    def __init__(self, sources: list[tuple], allow_leading_assistant: bool = False,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        self.sources = [(source[0], source[1]) for source in sources]
        self.fingerprints = [source[2] for source in sources]
        self.parts = [source[3] if len(source) > 3 else [Part(source[1], source[2], len(source[0]),
                                                              lambda table=source[0]: table)]
                      for source in sources]
        self.allow_leading_assistant = allow_leading_assistant
        self.max_record_bytes = max_record_bytes
        self.offsets = np.cumsum([0] + [len(table) for table, _ in self.sources])

    @classmethod
    def open(cls, paths: list[str], cache_dir: str | os.PathLike, image_root: str | None = None,
             allow_leading_assistant: bool = False, image_roots: list[str | None] | None = None,
             max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
             media_roots: tuple[str, ...] | list[str] = ()) -> RecordStore:
        """The sources of ``paths``; ``image_roots`` (one per path, None: ``image_root``) is each source's own root;
        a JSON/JSONL record over ``max_record_bytes`` is a bad record (``record_too_large``) left unread;
        ``media_roots`` are further folders every source's media may lie in."""
        cache = Path(cache_dir)
        roots = image_roots or [None] * len(paths)
        media = tuple(dict.fromkeys(map(os.path.abspath, media_roots)))
        return cls([_open_source(Path(path), cache, image_root if root is None else root, max_record_bytes, media)
                    for path, root in zip(paths, roots, strict=True)], allow_leading_assistant, max_record_bytes)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(source number, row in that source) of record ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"record index {index} out of range for {len(self)} records")
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return source, index - int(self.offsets[source])

    def __getitem__(self, index: int) -> MLLMRecord:
        source, row = self.locate(index)
        table, rows = self.sources[source]
        return rows.record(table, row, self.allow_leading_assistant)

    def origin(self, index: int) -> str:
        source, row = self.locate(index)
        table, rows = self.sources[source]
        return rows.origin(table, row)


def source_kind(path: str | os.PathLike) -> str:
    """What ``path`` is as a source: ``"json"``, ``"jsonl"``, ``"parquet"``, ``"saved"`` (a folder written by
    ``datasets``' ``save_to_disk``), or a shard source (``shards.py``): ``"webdataset"`` (tar shards),
    ``"energon"`` (an Energon-prepared folder, ``energon.py``), ``"parquet_shards"`` or ``"arrow_shards"``;
    otherwise an :class:`MLLMRecordError` (reason ``invalid_source``) naming the path and why not. The one place
    that decides what a source is: the run's config check asks it before anything is read, and
    :meth:`RecordStore.open` opens a source by it."""
    path = Path(path)
    if is_energon_folder(path):
        energon_index(path)  # reads the split part: a folder energon cannot read stops here
        kind = "energon"
    elif path.is_dir():
        try:
            _saved_folder(path)
        except MLLMRecordError as err:
            shards = shard_files(path)
            if shards is None:
                raise MLLMRecordError(f"{err}; nor does it hold .tar, .parquet or .arrow shards",
                                      "invalid_source") from None
            return shards[0]
        kind = "saved"
    elif (not path.exists() and is_pattern(path)) or path.suffix.lower() == ".tar":
        shards = shard_files(path)
        if shards is None:
            raise MLLMRecordError(f"{path}: data source not found", "invalid_source")
        return shards[0]
    elif not path.exists():
        raise MLLMRecordError(f"{path}: data source not found", "invalid_source")
    else:
        kind = path.suffix.lower().lstrip(".")
        if not path.is_file() or kind not in ("json", "jsonl", "parquet"):
            raise MLLMRecordError(f"{path}: unsupported source {path.suffix!r} (expected .json, .jsonl, .parquet, a "
                                  "folder written by datasets' save_to_disk, or shards: .tar, .parquet or .arrow "
                                  "files by folder or pattern)", "invalid_source")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise MLLMRecordError(f"{path}: data source is not readable (permissions)", "invalid_source")
    return kind


def _saved_folder(path: Path) -> Path:
    """The folder of the data set a ``save_to_disk`` folder holds: itself, or for a ``DatasetDict`` its ``train``
    split, or its only split. Reads the folder's markers only, so checking a source costs no loading."""
    import datasets

    if (path / datasets.config.DATASET_STATE_JSON_FILENAME).is_file() and \
            (path / datasets.config.DATASET_INFO_FILENAME).is_file():
        return path
    splits_file = path / datasets.config.DATASETDICT_JSON_FILENAME
    if not splits_file.is_file():
        raise MLLMRecordError(f"{path}: a folder source must be written by datasets' save_to_disk (it has no "
                              f"{datasets.config.DATASET_STATE_JSON_FILENAME} or "
                              f"{datasets.config.DATASETDICT_JSON_FILENAME})", "invalid_source")
    try:
        splits = list(json.loads(splits_file.read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MLLMRecordError(f"{splits_file}: unreadable split list ({err})", "invalid_source") from None
    if "train" not in splits and len(splits) != 1:
        raise MLLMRecordError(f"{path}: a DatasetDict with splits {splits} and no 'train': save one split",
                              "invalid_source")
    return path / ("train" if "train" in splits else splits[0])


def _open_source(path: Path, cache: Path, image_root: str | None, max_record_bytes: int,
                 media_roots: tuple[str, ...]) -> tuple:
    import datasets

    kind = source_kind(path)
    if kind in SHARD_KINDS or kind == "energon":
        return _open_shards(kind, path, cache, image_root, max_record_bytes, media_roots)
    folder = os.path.abspath(path.parent)
    root = os.path.abspath(image_root) if image_root is not None else folder
    identity = source_identity(path)
    if kind == "saved":
        table = datasets.Dataset.load_from_disk(str(_saved_folder(path)))
        return table, SourceRows(str(path), root, folder, json_rows=False, media_roots=media_roots), identity
    if kind == "parquet":
        table = datasets.Dataset.from_parquet(str(path), cache_dir=str(cache / "parquet"))
        return table, SourceRows(str(path), root, folder, json_rows=False, media_roots=media_roots), identity
    arrow = _converted_json(path, cache / "records", identity, max_record_bytes)
    rows = SourceRows(str(path), root, folder, json_rows=True, media_roots=media_roots)
    return datasets.Dataset.from_file(str(arrow)), rows, identity


def _open_shards(kind: str, path: Path, cache: Path, image_root: str | None, max_record_bytes: int,
                 media_roots: tuple[str, ...]) -> tuple:
    """A shard source: its concatenated table, its rows, its identity (its shards' together) and its shards as the
    measure pass's units."""
    prepared = energon_index(path) if kind == "energon" else None
    files = list(prepared.shards) if prepared is not None else shard_files(path)[1]
    folder = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    root = os.path.abspath(image_root) if image_root is not None else folder
    if kind in ("webdataset", "energon"):
        table, rows, parts = open_tar_shards(files, cache / "shards", root, folder, media_roots, str(path),
                                             max_record_bytes, prepared)
    else:
        table, rows, parts = open_table_shards(kind, files, cache, root, folder, media_roots, str(path))
    return table, rows, digest([part.identity for part in parts]), parts


def _converted_json(path: Path, cache: Path, identity: str, max_record_bytes: int) -> Path:
    """The Arrow file of a JSON/JSONL source, converted under a file lock (several ranks may ask at once) and
    published by rename, so a reader never sees half a file."""
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{path.stem[:40]}-{digest([STORE_FORMAT, identity, max_record_bytes])}.arrow"
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            partial = target.with_suffix(".partial")
            with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, _SCHEMA) as writer:
                for columns in _json_batches(path, max_record_bytes):
                    writer.write_batch(pa.record_batch([pa.array(column, kind) for column, kind in
                                                        zip(columns, _SCHEMA.types)], schema=_SCHEMA))
            os.replace(partial, target)
    return target


def _json_batches(path: Path, max_record_bytes: int) -> Iterator[tuple[list[str], list[bytes], list[str | None]]]:
    """Rows of a JSON/JSONL file in batches of ``(origins, raws, refused)``: JSONL lines as they are (blank ones
    skipped), a JSON list's records serialised back one by one (the list must parse whole; see
    :func:`iter_json_values`); a record over the size limit has no text and its error's message in ``refused``."""
    name = str(path)
    if path.suffix.lower() == ".jsonl":
        rows = jsonl_lines(path, name, max_record_bytes)
    else:
        rows = ((origin, value if isinstance(value, MLLMRecordError) else
                 json.dumps(value, ensure_ascii=False).encode())
                for origin, value in iter_json_values(path, name, max_record_bytes))
    while batch := list(islice(rows, _ROWS_PER_BATCH)):
        yield ([origin for origin, _ in batch],
               [b"" if isinstance(raw, MLLMRecordError) else raw for _, raw in batch],
               [str(raw) if isinstance(raw, MLLMRecordError) else None for _, raw in batch])
