"""Energon-prepared datasets (``energon prepare``) as one ``data.sources`` entry, read through Energon's own index.

A folder holding ``.nv-meta/`` is a WebDataset that megatron-energon prepared: ``.info.json`` (or the older
``.info.yaml``) counts each shard's samples, ``split.yaml`` names the shards of each split part and what it excludes
(whole shards, or samples as ``shard.tar/key``), ``index.sqlite`` says where each sample's parts lie in its shard, and
``dataset.yaml`` says how Energon's loader types a sample. Such a folder is read as its ``train`` split part, exactly
as Energon's loader reads it: the part's shards and counts come from Energon's own ``WebdatasetMeta.from_config``
(brace patterns and excludes applied), so held-out shards are never trained, and an excluded sample is no record.

The records are those of a WebDataset source (``shards.py``): a sample's ``json`` part holds the record (LLaVA,
ShareGPT or OpenAI messages), its image and video parts are its media, read in place, and origins are
``shard.tar#key``. Only each shard's index comes from elsewhere: its rows are read from Energon's ``index.sqlite``
(the ``samples`` and ``sample_parts`` tables), not from a scan of the tar, and cached as a tar shard's index is,
keyed by the shard and by the index and excludes it was read with. So a plan over an Energon source is a plan over
(shard, sample) ids, measured per shard across ranks, with the same packs as the same records in any other source.

Only crude datasets are read (``dataset.yaml`` absent, or ``CrudeWebdataset``, whose samples are their raw parts): a
dataset typed by a field map or a sample loader (``VQASample``, ``CaptioningSample``, ...) means something else by
its parts, and is refused in one line naming its ``dataset.yaml``.

megatron-energon is an optional dependency (``pip install 'vlm-packing[energon]'``; the ``dev`` extra includes it):
a run naming an Energon folder without it stops at the config check, saying what to install.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .shards import add_member, key_columns
from .sources import MLLMRecordError

META_FOLDER = ".nv-meta"  # what `energon prepare` adds to a folder of shards (megatron.energon's MAIN_FOLDER_NAME)
SPLIT_PART = "train"
CRUDE_CLASS = "CrudeWebdataset"
_PARTS_QUERY = ("SELECT s.sample_index, s.sample_key, p.part_name, p.content_byte_offset, p.content_byte_size "
                "FROM samples AS s LEFT JOIN sample_parts AS p "
                "ON p.tar_file_id = s.tar_file_id AND p.sample_index = s.sample_index "
                "WHERE s.tar_file_id = ? AND s.sample_index < ? ORDER BY s.sample_index, p.content_byte_offset")


def is_energon_folder(path: str | os.PathLike) -> bool:
    return os.path.isdir(os.path.join(path, META_FOLDER))


@dataclass(frozen=True)
class EnergonIndex:
    """The ``train`` part of an Energon-prepared folder: its shards (absolute paths, in the part's order) and, per
    shard, its number in Energon's index (``tar_file_id``), its sample count and the keys the split excludes. The
    ``shards.PreparedIndex`` of the folder's tar shards."""

    folder: str
    shards: tuple[str, ...]
    tar_file_ids: tuple[int, ...]
    counts: tuple[int, ...]
    excluded: tuple[frozenset[str], ...]
    index_identity: str

    @property
    def index_path(self) -> str:
        return os.path.join(self.folder, META_FOLDER, "index.sqlite")

    def key(self, number: int) -> Any:
        return [self.index_identity, self.tar_file_ids[number], self.counts[number], sorted(self.excluded[number])]

    def columns(self, shard: str, number: int) -> dict[str, list]:
        """Shard ``number``'s rows from ``index.sqlite``: its first ``count`` samples in sample order, each with its
        parts in byte order; a sample the split excludes is left out."""
        count, excluded = self.counts[number], self.excluded[number]
        with closing(_read_only(self.index_path)) as db:
            rows = db.execute(_PARTS_QUERY, (self.tar_file_ids[number], count)).fetchall()
        size = os.path.getsize(shard)
        keys: dict[str, dict[str, Any]] = {}
        samples = set()
        for sample_index, key, part, offset, length in rows:
            samples.add(sample_index)
            if key in excluded:
                continue
            keys.setdefault(key, {"json": None, "media": [], "refused": None})
            if part is not None:
                add_member(keys, shard, key, f"{key}.{part}", part, offset, length, size)
        if len(samples) != count:
            raise MLLMRecordError(f"{self.folder}: Energon's index holds {len(samples)} samples of {shard}, its "
                                  f"{META_FOLDER} info counts {count}: the index is stale, run `energon prepare` again",
                                  "invalid_source")
        return key_columns(shard, number, keys)


def energon_index(path: str | os.PathLike) -> EnergonIndex:
    """The ``train`` part of the Energon-prepared folder ``path``, read by megatron-energon; an ``invalid_source``
    error naming the folder when it cannot be read (energon not installed, not a prepared WebDataset, a typed
    dataset, no ``train`` part, an index without sample parts)."""
    folder = os.path.abspath(path)
    meta = Path(folder) / META_FOLDER
    try:
        from megatron.energon.epathlib import EPath
        from megatron.energon.eyaml import load_yaml
        from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
        from megatron.energon.flavors.webdataset.metadata import EnergonDatasetType, WebdatasetMeta, get_dataset_type
    except ImportError:
        raise MLLMRecordError(f"{folder}: an Energon-prepared dataset ({META_FOLDER}) is read through "
                              "megatron-energon's index, which is not installed: pip install 'vlm-packing[energon]'",
                              "invalid_source") from None
    if get_dataset_type(EPath(folder)) != EnergonDatasetType.WEBDATASET:
        raise MLLMRecordError(f"{folder}: {META_FOLDER} holds no prepared WebDataset (no .info.json or .info.yaml): "
                              "run `energon prepare` on the folder", "invalid_source")
    config = meta / "dataset.yaml"
    if config.is_file():
        typed = load_yaml(config.read_bytes()) or {}
        if typed.get("__class__") != CRUDE_CLASS:
            kind = (typed.get("sample_type") or {}).get("__class__") or typed.get("__class__") or "a sample loader"
            raise MLLMRecordError(f"{config}: the dataset is typed as {kind}; only crude datasets ({CRUDE_CLASS}) are "
                                  "read, each sample's json part holding its record", "invalid_source")
    try:
        split = WebdatasetMeta.from_config(EPath(folder), split_part=SPLIT_PART)
    except KeyError as err:  # a shard of the part that the info does not count
        raise MLLMRecordError(f"{folder}: the {SPLIT_PART!r} split part names shard {err} which {META_FOLDER} does "
                              "not count: run `energon prepare` again", "invalid_source") from None
    except (AssertionError, EmptyDatasetError, FileNotFoundError, ValueError) as err:
        raise MLLMRecordError(f"{folder}: no readable {SPLIT_PART!r} split part in {META_FOLDER} ({err})",
                              "invalid_source") from None
    index = meta / "index.sqlite"
    if not _has_sample_parts(index):
        raise MLLMRecordError(f"{index}: the index has no sample parts (prepared by an older megatron-energon): run "
                              "`energon prepare` again", "invalid_source")
    from .store import digest, file_identity

    shards = tuple(os.path.join(folder, shard.name) for shard in split.shards)
    unreadable = next((shard for shard in shards if not os.access(shard, os.R_OK)), None)
    if unreadable is not None:
        raise MLLMRecordError(f"{folder}: shard {unreadable} of the {SPLIT_PART!r} split part is missing or not "
                              "readable", "invalid_source")
    tar_file_ids = {name: number for number, name in enumerate(split.info_shard_files)}
    return EnergonIndex(
        folder, shards, tuple(tar_file_ids[shard.name] for shard in split.shards),
        tuple(shard.count for shard in split.shards),
        tuple(frozenset(excluded[len(shard.name) + 1:] for excluded in split.sample_excludes
                        if excluded.startswith(f"{shard.name}/")) for shard in split.shards),
        digest(file_identity(index)))


def _has_sample_parts(index: Path) -> bool:
    if not index.is_file():
        return False
    with closing(_read_only(index)) as db:
        found = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='sample_parts'").fetchone()
    return found is not None


def _read_only(index: str | os.PathLike) -> sqlite3.Connection:
    """Energon's index opened read-only (a URI, percent-encoded: a folder may hold ``?`` or ``#``)."""
    return sqlite3.connect(f"{Path(index).absolute().as_uri()}?mode=ro", uri=True)
