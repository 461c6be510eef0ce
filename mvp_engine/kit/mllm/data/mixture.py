"""Weighted mixtures: the entries of ``data.sources`` and the records each epoch draws from them, model-free.

An entry is a path or a mapping ``{path, repeat, name, image_root}``. ``repeat`` is how many times the source's
records are drawn per epoch (InternVL's ``repeat_time``): its integer part takes every record that many times, its
fraction a seeded sample of ``floor(fraction x n)`` records without replacement. Unlike InternVL, which samples once
when the data is loaded, the fraction is drawn afresh every epoch (``numpy`` generator seeded by the data seed, the
epoch and the source's position), so an epoch sees other records of a down-weighted source while the counts stay
exact: the plan, the step estimate and a resumed run all recompute the same draw. Unlike LLaMA-Factory's
``interleave_datasets`` probabilities, the per-epoch counts are fixed, not random, so the number of optimizer steps
is known before training.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .shards import is_pattern

SOURCE_KEYS = ("path", "repeat", "name", "image_root")


@dataclass(frozen=True)
class MLLMSource:
    """One entry of ``data.sources``, validated; ``name`` defaults to the shortest path that tells it from the
    other entries (:func:`source_entries`)."""

    path: str
    repeat: float = 1.0
    name: str = ""
    image_root: str | None = None

    def draw_size(self, num_records: int) -> int:
        """Records this source gives an epoch: ``floor(repeat x n)``, exact for the decimal ``repeat`` as written
        (2.3 x 10 is 23, not the 22 binary floating point would give)."""
        return math.floor(Fraction(repr(float(self.repeat))) * num_records)


def source_entries(entries: Sequence[Any], key: str = "data.sources") -> list[MLLMSource]:
    """The entries of ``key`` as :class:`MLLMSource`; a bad one raises one ``ValueError`` line naming it
    (``data.sources[1]: ...``): an unknown key, a missing or empty path, a repeat that is not a number >= 0, a name
    given twice, one file listed twice without names.

    An entry without a ``name`` is named by the shortest tail of its path that no other entry shares: the file's
    stem alone when it is unique (``train``), else with as many parent folders as it takes (``llava/train`` and
    ``sharegpt4v/train``), else the file name with its suffix (``mix.json`` and ``mix.jsonl``). Such a name never
    takes one a user gave, so only names given twice are refused."""
    sources = [_entry(entry, f"{key}[{index}]") for index, entry in enumerate(entries)]
    given: dict[str, int] = {}
    for index, source in enumerate(sources):
        if source.name and source.name in given:
            raise ValueError(f"{key}[{index}]: name {source.name!r} is already used by {key}[{given[source.name]}] "
                             "(give each source its own name)")
        if source.name:
            given[source.name] = index
    unnamed = [index for index, source in enumerate(sources) if not source.name]
    names = _default_names([sources[i].path for i in unnamed], set(given))
    for index, name in zip(unnamed, names):
        if name is None:
            tails = _tails(sources[index].path)
            twin = next((i for i in unnamed if i != index and _tails(sources[i].path) == tails), None)
            if twin is None:
                raise ValueError(f"{key}[{index}]: every name its path gives ({', '.join(tails)}) is taken by "
                                 "another entry: give it its own name")
            first, later = sorted((index, twin))
            raise ValueError(f"{key}[{later}]: {sources[later].path} is already {key}[{first}] (a repeat draws a "
                             "source more often; to list it twice, give each entry its own name)")
        sources[index] = replace(sources[index], name=name)
    return sources


def _default_names(paths: list[str], taken: set[str]) -> list[str | None]:
    """For each path, its first tail (:func:`_tails`) that is not in ``taken`` and that no other path has among its
    own tails: names unique by construction. None for a path whose tails are all shared (the same file twice)."""
    tails = [_tails(path) for path in paths]
    shared = Counter(tail for own in tails for tail in set(own))
    return [next((tail for tail in own if shared[tail] == 1 and tail not in taken), None) for own in tails]


def _tails(path: str) -> list[str]:
    """Candidate names of a source, shortest first: its stem, then the stem under 1, 2, ... parent folders, then
    the file name with its suffix under 0, 1, ... folders (the absolute path: two spellings of one file agree).
    A shard pattern (``/data/cc/shard-{0000..0999}.tar``) is named by its folder first (``cc``, ``data/cc``)."""
    *folders, file = Path(os.path.abspath(path)).parts[1:]
    own = ["/".join(folders[len(folders) - depth:]) for depth in range(1, len(folders) + 1)] if is_pattern(file) else []
    return own + ["/".join([*folders[len(folders) - depth:], last])
                  for last in (Path(file).stem, file) for depth in range(len(folders) + 1)]


def _entry(entry: Any, where: str) -> MLLMSource:
    if isinstance(entry, (str, os.PathLike)):
        entry = {"path": entry}
    if not hasattr(entry, "keys"):
        raise ValueError(f"{where}: {entry!r} is neither a path nor a mapping with keys {list(SOURCE_KEYS)}")
    unknown = sorted(str(k) for k in entry.keys() if k not in SOURCE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(SOURCE_KEYS)})")
    path = entry.get("path")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{where}: 'path' is missing or empty (got {path!r})")
    repeat = entry.get("repeat", 1.0)
    if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not 0 <= repeat < math.inf:
        raise ValueError(f"{where}: repeat={repeat!r} is invalid: allowed a number >= 0 (2: every record twice; "
                         "0.5: a seeded half of them)")
    name = entry.get("name") or ""
    if not isinstance(name, str):
        raise ValueError(f"{where}: name={name!r} is invalid: allowed a string")
    root = entry.get("image_root")
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ValueError(f"{where}: image_root={root!r} is invalid: allowed null or a folder")
    return MLLMSource(str(path), float(repeat), name, None if root is None else str(root))


def epoch_draw(sources: Sequence[MLLMSource], offsets: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Record indices one epoch draws, source by source (source ``s`` holds records ``offsets[s]:offsets[s+1]``):
    each record ``floor(repeat)`` times, then a sorted seeded sample without replacement for the fraction. Every
    rank computes the same array from the same arguments."""
    parts = []
    for s, source in enumerate(sources):
        start, n = int(offsets[s]), int(offsets[s + 1] - offsets[s])
        whole, rest = divmod(source.draw_size(n), n) if n else (0, 0)
        records = np.arange(start, start + n, dtype=np.int64)
        parts.extend([records] * whole)
        if rest:
            rng = np.random.default_rng([seed, epoch, s])
            parts.append(start + np.sort(rng.choice(n, size=rest, replace=False)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
