"""Every bad record of a data set before a long run, in one pass, read the way training reads it.

A run leaves bad records out as it meets them, and a corrupt image body shows only when a pack is decoded,
mid-epoch. :func:`find_bad_records` opens the sources as the run's :class:`RecordStore` (every source kind), measures
them with the run's own measure pass (parallel, cached: what a run then finds in the cache) and, with ``decode``,
encodes every measured record in parallel processes, as a pack would. Each bad record is named by its origin
(``file:line``, ``file#row`` or ``folder#row``) with its fault class and the stage that found it.
"""

from __future__ import annotations

import multiprocessing
import os
from contextlib import nullcontext

import numpy as np
from tqdm.auto import tqdm

from .bad_records import BadRecord, BadRecordReport
from .dataset import MLLMDataKit
from .measure import SampleMetas, encode_as_measured, measure_store
from .sample import MLLMSampleEncoder
from .sources import MLLMRecordError
from .spec import MLLMDataSpec
from .store import RecordStore

DECODE_CHUNK = 32  # records per decode task: few enough to balance the processes, enough to amortise the hand-off

_DECODING: tuple[RecordStore, MLLMSampleEncoder, np.ndarray] | None = None  # inherited by forked decode processes


def find_bad_records(data_spec: MLLMDataSpec, encoder: MLLMSampleEncoder, *, decode: bool = False,
                     workers: int | None = None) -> BadRecordReport:
    """Every bad record of ``data_spec``'s sources, once each (policy ``skip``: nothing stops the check).

    ``workers``: processes measuring and decoding; None measures with ``data.measure_workers`` and decodes with one
    process per CPU core.
    """
    report = BadRecordReport("skip", max_fraction=1.0)
    store = MLLMDataKit.open_store(data_spec)
    report.records_read = len(store)
    metas = measure_store(store, encoder, report, data_spec.cache_dir, workers or data_spec.measure_workers,
                          data_spec.measure_cache)
    if decode:
        for bad in decode_faults(store, encoder, metas, workers):
            report.add(bad)
    return report


def decode_faults(store: RecordStore, encoder: MLLMSampleEncoder, metas: SampleMetas,
                  workers: int | None = None) -> list[BadRecord]:
    """The faults of encoding every usable record of ``store`` (stage ``decode``), in record order, on up to
    ``workers`` forked processes (None: one per CPU core; they inherit the store and the encoder, nothing is
    pickled but record indices)."""
    global _DECODING
    usable = np.flatnonzero(metas.usable)
    chunks = [usable[k:k + DECODE_CHUNK].tolist() for k in range(0, len(usable), DECODE_CHUNK)]
    processes = min(workers or os.cpu_count() or 1, len(chunks))
    _DECODING = (store, encoder, metas.length)
    faults: list[BadRecord] = []
    try:
        with (multiprocessing.get_context("fork").Pool(processes) if processes > 1 else nullcontext()) as pool, \
                tqdm(total=len(usable), desc="decoding", unit="record", mininterval=2) as progress:
            for chunk, bads in zip(chunks, pool.imap(_decode_chunk, chunks) if pool else map(_decode_chunk, chunks)):
                faults.extend(bads)
                progress.update(len(chunk))
    finally:
        _DECODING = None
    return faults


def _decode_chunk(indices: list[int]) -> list[BadRecord]:
    store, encoder, lengths = _DECODING
    bad = []
    for index in indices:
        try:
            encode_as_measured(encoder, store[index], int(lengths[index]))
        except MLLMRecordError as err:
            bad.append(BadRecord.from_error(err, "decode"))
    return bad
