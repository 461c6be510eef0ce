"""Measuring every record once: lengths, media counts and bad-record verdicts as numpy columns, cached on disk.

Planning needs each record's token length and media count (read from text and image headers). Measuring costs
about a millisecond per record (chat template rendering, tokenizing), hours at ten million records, so it runs in
parallel processes (``datasets.Dataset.map(num_proc=...)``) and its result is cached per source under
``<cache>/measure/<key>``, keyed by:

* the source's identity (``store.source_identity``: path, size, modification and status-change times, a hash of
  the file's ends; every file of a saved data set),
* the encoder's fingerprint (:meth:`fingerprint` of the encoder: tokenizer, chat template, image-processor
  settings, and a ``measure_version`` the encoder bumps when its counting changes),
* the read settings (``image_root``, ``media_roots``, ``allow_leading_assistant``, ``max_record_bytes``: a record
  refused under one is read again under another) and this module's ``MEASURE_FORMAT``;

and checked against the media files' identity (size and modification time of every image, video or frame folder
a record names, missing ones included): a second start reads the cache, any change measures the source again. An
encoder without a ``fingerprint`` method is measured every time (nothing safe to key a cache on).

Under data parallelism every rank opens the same cache entry under a file lock: the first measures, the others wait
on the lock (not in a collective, whose timeout is shorter than a cold measure of millions of records) and then read
what it wrote. Several nodes share the work when the cache folder is on a shared file system.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.feather as feather
from filelock import FileLock, Timeout

from .bad_records import BadRecordReport
from .members import is_member_path
from .sample import MLLMRecord, MLLMSample, MLLMSampleEncoder, SampleMeta, measure_each
from .share import run_shares
from .sources import MLLMRecordError
from .store import RecordStore, SourceRows, digest

MEASURE_FORMAT = 3  # bump when the cached columns change meaning (2: media_tokens, media_sq; 3: media confined)
ROWS_PER_WORKER = 2_000  # fewer rows than this per process: starting the process costs more than it saves
META_COLUMNS = ("length", "num_media", "media_end", "first_supervised", "media_tokens", "media_sq")
WIDE_COLUMNS = ("media_sq",)  # int64: a square of tens of thousands of tokens overflows int32
BAD_COLUMNS = ("bad_stage", "bad_reason", "bad_message", "bad_id")
DONE = "done.json"
MEDIA = "media.arrow"
MEASURE_ENCODE_MISMATCH = "measure_encode_mismatch"  # the bad-record reason of a sample that left its slot


@dataclass
class SampleMetas:
    """:class:`SampleMeta` of every record as int32 columns (``media_sq`` int64; 29 bytes a record with ``usable``,
    not a Python object each); ``usable`` is False for a record that could not be measured (it is in the bad-record
    report)."""

    length: np.ndarray
    num_media: np.ndarray
    media_end: np.ndarray
    first_supervised: np.ndarray
    media_tokens: np.ndarray
    media_sq: np.ndarray
    usable: np.ndarray

    @classmethod
    def from_list(cls, metas: list[SampleMeta | None]) -> SampleMetas:
        rows = [tuple(getattr(m, name) for name in META_COLUMNS) if m else (0,) * len(META_COLUMNS) for m in metas]
        columns = np.asarray(rows, dtype=np.int64).reshape(len(metas), len(META_COLUMNS)).T
        return cls(*(column.astype(_dtype(name)) for name, column in zip(META_COLUMNS, columns)),
                   usable=np.asarray([m is not None for m in metas], dtype=bool))

    def __len__(self) -> int:
        return len(self.length)

    def __getitem__(self, index: int) -> SampleMeta | None:
        if not self.usable[index]:
            return None
        return SampleMeta(*(int(getattr(self, name)[index]) for name in META_COLUMNS))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _dtype(column: str) -> type:
    return np.int64 if column in WIDE_COLUMNS else np.int32


def default_cache_dir() -> Path:
    """``$VLM_PACKING_CACHE``, else ``~/.cache/vlm_packing``."""
    return Path(os.environ.get("VLM_PACKING_CACHE") or Path.home() / ".cache" / "vlm_packing")


def encoder_fingerprint(encoder: MLLMSampleEncoder) -> str | None:
    fingerprint = getattr(encoder, "fingerprint", None)
    return None if fingerprint is None else str(fingerprint())


def measure_list(records: list[MLLMRecord], encoder: MLLMSampleEncoder, report: BadRecordReport) -> SampleMetas:
    """Records already in memory (tests, tools over a few records), measured here, uncached."""
    metas = []
    for record in records:
        try:
            metas.append(encoder.measure(record))
        except MLLMRecordError as err:
            report.add_error(err, "measure")
            metas.append(None)
    return SampleMetas.from_list(metas)


def encode_as_measured(encoder: MLLMSampleEncoder, record: MLLMRecord, measured_length: int) -> MLLMSample:
    """``encoder.encode(record)``, or a bad record (``measure_encode_mismatch``) when the sample is not the length it
    was measured at: the plan holds a slot of the measured size, so such a sample cannot fit it."""
    sample = encoder.encode(record)
    if sample.length != measured_length:
        raise MLLMRecordError(
            f"{record.origin}: encoder.measure gave {measured_length} tokens but encode produced {sample.length}: "
            "a media file changed after it was measured (the next start measures it again), or the encoder "
            "breaks the measure/encode contract", MEASURE_ENCODE_MISMATCH, record_id=record.record_id)
    return sample


def measure_store(store: RecordStore, encoder: MLLMSampleEncoder, report: BadRecordReport,
                  cache_dir: str | os.PathLike | None = None, workers: int = 0, use_cache: bool = True,
                  rank: int = 0, world_size: int = 1) -> SampleMetas:
    """Every record of ``store`` measured (or read from the cache); bad ones go to ``report`` in record order
    (under ``on_bad_record=error`` the first one is raised). The shards of shard sources are shared out: this
    process (rank ``rank`` of ``world_size``, with ``workers`` processes of its own) measures the ones no other
    process has taken, its own share first (``share.py``), then reads them all from the cache."""
    fingerprint = encoder_fingerprint(encoder) if use_cache else None
    workers = workers or os.cpu_count() or 1
    units = [(part, _Measure(part.rows, encoder, store.allow_leading_assistant), len(parts) > 1)
             for parts in store.parts for part in parts]
    folders = [None] * len(units)
    if fingerprint is not None:
        folders = entry_folders(store, fingerprint, cache_dir)
        shared = [(part.table, measure, folder) for (part, measure, sharded), folder in zip(units, folders)
                  if sharded and part.num_rows]
        run_shares(functools.partial(_claim, shared), len(shared), rank, world_size, workers)
    parts = []
    for (part, measure, sharded), folder in zip(units, folders):
        if not part.num_rows:  # nothing to measure (``map`` over no rows returns no columns at all)
            columns = {name: np.zeros(0, dtype=_dtype(name)) for name in META_COLUMNS}
            columns.update(usable=np.zeros(0, dtype=bool), bad=[])
        elif folder is None:
            with tempfile.TemporaryDirectory() as scratch:
                columns = _columns(_run_map(part.table(), measure, Path(scratch), 1 if sharded else workers).data.table)
        else:
            columns = _columns(_cached_map(part.table, measure, folder, workers))
        parts.append(columns)
    metas = SampleMetas(*(np.concatenate([p[name] for p in parts]) for name in META_COLUMNS),
                        usable=np.concatenate([p["usable"] for p in parts]))
    for part in parts:
        for bad in part["bad"]:
            err = MLLMRecordError(bad["bad_message"], bad["bad_reason"], record_id=bad["bad_id"])
            report.add_error(err, bad["bad_stage"])
    return metas


def entry_folders(store: RecordStore, fingerprint: str, cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """The measure cache entry of every part of ``store`` (``store.parts``, flattened), for an encoder of this
    ``fingerprint``: what a part's measured table is keyed by (see the module's docstring)."""
    root = Path(cache_dir or default_cache_dir()) / "measure"
    return [root / digest([MEASURE_FORMAT, part.identity, fingerprint, part.rows.image_root,
                           sorted(part.rows.media_roots), store.allow_leading_assistant, store.max_record_bytes])
            for parts in store.parts for part in parts]


class _Measure:
    """The ``datasets.map`` function: one batch of rows -> meta columns, verdict columns, media paths."""

    def __init__(self, rows: SourceRows, encoder: MLLMSampleEncoder, allow_leading_assistant: bool):
        self.rows = rows
        self.encoder = encoder
        self.allow_leading_assistant = allow_leading_assistant

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in (*META_COLUMNS, *BAD_COLUMNS, "media")}
        rows: list[tuple[MLLMRecord | MLLMRecordError, list[str]]] = []
        for origin, raw in self.rows.raw_records(batch, indices):
            try:
                if isinstance(raw, MLLMRecordError):
                    raise raw
                record = self.rows.parse(raw, origin, self.allow_leading_assistant)
                # a shard's members are covered by the shard's identity (the cache key), not watched one by one
                rows.append((record, [p for p in record.media_paths if not is_member_path(p)]))
            except MLLMRecordError as err:
                rows.append((err, [err.media_path] if err.media_path else []))
        measured = iter(self._measure([record for record, _ in rows if not isinstance(record, MLLMRecordError)]))
        for record, media in rows:
            stage, meta = ("read", record) if isinstance(record, MLLMRecordError) else ("measure", next(measured))
            if isinstance(meta, MLLMRecordError):
                media = [meta.media_path] if meta.media_path else media
                values, verdict = (0,) * len(META_COLUMNS), (stage, meta.reason, str(meta), meta.record_id)
            else:
                values, verdict = tuple(getattr(meta, name) for name in META_COLUMNS), (None,) * 4
            for name, value in zip((*META_COLUMNS, *BAD_COLUMNS), (*values, *verdict)):
                out[name].append(value)
            out["media"].append(media)
        return out

    def _measure(self, records: list[MLLMRecord]) -> list[SampleMeta | MLLMRecordError]:
        """Each record's meta or its error: by the encoder's ``measure_batch`` where it has one (a whole batch at
        once, ``chat.ChatTemplateEncoder``), else record by record."""
        measure_batch = getattr(self.encoder, "measure_batch", None)
        return measure_each(self.encoder, records) if measure_batch is None else measure_batch(records)


def _features():
    """The measured columns' types, declared: a batch whose verdicts are all None must not fix them as null."""
    import datasets

    return datasets.Features({**{name: datasets.Value("int64" if name in WIDE_COLUMNS else "int32")
                                 for name in META_COLUMNS},
                              **{name: datasets.Value("string") for name in BAD_COLUMNS},
                              "media": datasets.List(datasets.Value("string"))})


def _run_map(table, measure: _Measure, folder: Path, workers: int):
    """``measure`` over ``table`` into Arrow files in ``folder``, on up to ``workers`` processes."""
    num_proc = max(1, min(workers, len(table) // ROWS_PER_WORKER))
    return table.map(measure, batched=True, batch_size=256, with_indices=True, remove_columns=table.column_names,
                     features=_features(), num_proc=num_proc if num_proc > 1 else None,
                     cache_file_name=str(folder / "metas.arrow"), load_from_cache_file=False,
                     new_fingerprint=folder.name, desc=f"measuring {measure.rows.name}")


def _cached_map(make_table, measure: _Measure, folder: Path, workers: int, wait: bool = True, read: bool = True):
    """The measured Arrow table of one part (``make_table()`` gives its rows) from ``folder`` when it is complete
    and its media are unchanged, else measured into it; one process at a time (the others wait, then read).
    ``wait=False``: None at once when another process holds it; ``read=False``: True instead of the table (the
    shard share's claim). A hit reads the Arrow files memory-mapped, without a ``datasets.Dataset`` (~10 ms each,
    what a warm start of thousands of shards would otherwise spend), and without the lock where the entry watches no
    media file (a tar shard's: its media are members, covered by its key): ``done.json`` is written last, and such
    an entry is never measured again under the same key."""
    if read and (folder / DONE).is_file():  # an entry that watches no media file never changes: read without a lock
        entry = json.loads((folder / DONE).read_text())
        if not entry.get("media", 1):
            return _read_entry(folder, entry)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            return None
        print(f"waiting for another process to finish measuring {measure.rows.name} (cache {folder})", flush=True)
        lock.acquire()
    try:
        done = folder / DONE
        if done.is_file():
            entry = json.loads(done.read_text())
            # an entry that watches no media file (a tar shard's media are members) skips reading its empty table
            changed = _changed_media(folder / MEDIA) if entry.get("media", 1) else 0
            if not changed:
                return _read_entry(folder, entry) if read else True
            print(f"{measure.rows.name}: {changed} media file(s) changed since they were measured; measuring again",
                  flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        measured = _run_map(make_table(), measure, folder, workers)
        media = _write_media(measured.data.table, folder / MEDIA)
        files = [os.path.relpath(f["filename"], folder) for f in measured.cache_files]
        partial = folder / (DONE + ".partial")  # published by rename: a reader without the lock sees it whole
        partial.write_text(json.dumps({"files": files, "rows": len(measured), "media": media,
                                       "measured_by": measured_by()}))
        os.replace(partial, done)
        return measured.data.table if read else True
    finally:
        lock.release()


def _read_entry(folder: Path, entry: dict) -> pa.Table:
    """A complete cache entry's measured table, its Arrow files memory-mapped."""
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(folder / f))).read_all() for f in entry["files"]])


def _claim(units: list[tuple], order: list[int]) -> None:
    """Measure into the cache every unit of ``order`` (``(make_table, measure, folder)`` each) that no process has
    measured, skipping those another process holds until they are done (``share.py``); one process each, the
    shares being the parallelism."""
    pending, waiting = list(dict.fromkeys(order)), False
    while pending:
        held = []
        for i in pending:
            table, measure, folder = units[i]
            if not (folder / DONE).is_file() and _cached_map(table, measure, folder, 1, wait=False,
                                                             read=False) is None:
                held.append(i)
        pending = held
        if pending:
            if not waiting:
                print(f"waiting for {len(pending)} shard(s) other processes are measuring", flush=True)
                waiting = True
            time.sleep(0.2)


def measured_by() -> dict:
    """Who measured a cache entry (kept in its ``done.json``): the rank, the host and the process."""
    return {"rank": int(os.environ.get("RANK", 0)), "host": socket.gethostname(), "pid": os.getpid()}


def _columns(table: pa.Table) -> dict:
    """Numpy meta columns, the usable mask and the verdict of each bad row (in row order), from a measured table."""
    columns = {name: table.column(name).to_numpy().astype(_dtype(name)) for name in META_COLUMNS}
    bad_mask = pc.is_valid(table.column("bad_reason")).to_numpy(zero_copy_only=False)
    bad_rows = np.flatnonzero(bad_mask)
    columns["usable"] = ~bad_mask
    columns["bad"] = table.select(list(BAD_COLUMNS)).take(pa.array(bad_rows)).to_pylist() if len(bad_rows) else []
    return columns


def _media_identity(paths: list[str]) -> np.ndarray:
    """(size, mtime_ns) of each path, (-1, -1) for a missing one; stat calls in threads (network file systems)."""
    def identity(path: str) -> tuple[int, int]:
        try:
            stat = os.stat(path)
        except OSError:
            return -1, -1
        return stat.st_size, stat.st_mtime_ns

    if len(paths) > 1000:
        with ThreadPoolExecutor(16) as pool:
            found = list(pool.map(identity, paths, chunksize=256))
    else:
        found = [identity(path) for path in paths]
    return np.asarray(found, dtype=np.int64).reshape(len(paths), 2)


def _write_media(measured: pa.Table, path: Path) -> int:
    """The identity of every media file the measured records name, written to ``path``; how many there are."""
    paths = pc.unique(pc.list_flatten(measured.column("media"))).to_pylist()
    identity = _media_identity(paths)
    feather.write_feather(pa.table({"path": paths, "size": identity[:, 0], "mtime_ns": identity[:, 1]}), str(path))
    return len(paths)


def _changed_media(path: Path) -> int:
    """How many media files differ from what the cache saw (all of them when the table is missing)."""
    if not path.is_file():
        return 1
    table = feather.read_table(str(path))
    seen = np.stack([table.column("size").to_numpy(), table.column("mtime_ns").to_numpy()], axis=1)
    now = _media_identity(table.column("path").to_pylist())
    return int(np.any(seen != now, axis=1).sum())
