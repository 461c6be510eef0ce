"""Media stored inside a tar shard, named by a path string and read in place, without extracting the shard.

A record of a WebDataset shard (``shards.py``) names its media as members of the shard. Everything downstream of
reading (``MLLMRecord`` parts, the encoders, ``images.py``, ``video.py``) passes media around as path strings, so a
member gets one too: ``<shard>#<member>@<offset>:<size>``, the shard's absolute path, the member's name inside it
(what messages show) and where its bytes lie (``offset`` of its data, ``size`` in bytes, from the shard's index).
:func:`open_media` turns such a path into a file object over exactly those bytes (Pillow and PyAV read file objects
as they read files) and leaves any other path as it is. The shard's identity keys the measure cache, so a member
path needs no identity of its own (:func:`is_member_path` lets the cache skip it).
"""

from __future__ import annotations

import io
import os
import re

_MEMBER = re.compile(r"^(?P<shard>.+?\.tar)#(?P<name>.+)@(?P<offset>\d+):(?P<size>\d+)$")


def member_path(shard: str, name: str, offset: int, size: int) -> str:
    """The path string of member ``name`` of ``shard`` whose data is ``size`` bytes at ``offset``."""
    return f"{os.path.abspath(shard)}#{name}@{offset}:{size}"


def is_member_path(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and _MEMBER.match(path) is not None


def open_media(path: str | os.PathLike) -> str | os.PathLike | io.BytesIO:
    """``path`` itself, or for a member path its bytes read from the shard (one seek and one read; a shard that
    is gone raises ``FileNotFoundError``, as a missing file does, and one cut short an ``OSError``)."""
    match = _MEMBER.match(path) if isinstance(path, str) else None
    if match is None:
        return path
    offset, size = int(match["offset"]), int(match["size"])
    with open(match["shard"], "rb") as handle:
        handle.seek(offset)
        data = handle.read(size)
    if len(data) != size:
        raise OSError(f"member {match['name']} of {match['shard']} is cut short ({len(data)} of {size} bytes)")
    return io.BytesIO(data)
