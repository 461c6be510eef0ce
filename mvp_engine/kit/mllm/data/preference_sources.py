"""Reading preference pairs (one prompt, a chosen and a rejected answer) from JSON / JSONL / parquet files into
:class:`~.pairs.PreferenceRecord`, model-free. Two layouts are accepted, detected per record:

* **TRL style** — ``{"id"?, "prompt": str | [messages] (or "messages": [messages]), "chosen": str | message |
  [messages], "rejected": ..., "images"?: [str], "system"?: str}``; a string prompt is one user turn, a string
  answer one assistant turn.
* **LLaMA-Factory style** (ShareGPT) — ``{"id"?, "conversations": [{"from", "value"}, ...], "chosen": {"from":
  "gpt", "value"} | str, "rejected": ..., "images"?: [str], "system"?: str}``, ``<image>`` tags in the text.

Each answer is appended to the prompt and the conversation goes through the SFT reader's own
:func:`~.sources.parse_record` (media resolution and roots, tags, system prompts, role checks), so a pair's prompt
reads exactly as the same conversation would for SFT. Multi-turn prompts are kept; only the final answer is trained.

Bad pairs are bad records (one :class:`~.sources.MLLMRecordError` each, to ``on_bad`` or raised): an answer missing
or empty (``missing_answer``), the same answer twice (``identical_answers``), anything the SFT reader refuses. Pairs
too long for ``data.max_seq_len`` are dropped by the planner (reason ``overlong``), never truncated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .pairs import IDENTICAL_ANSWERS, MISSING_ANSWER, PreferenceRecord
from .sources import (
    DEFAULT_MAX_RECORD_BYTES,
    MLLMRecordError,
    decode_json_line,
    iter_json_values,
    jsonl_lines,
    parse_record,
)

SUFFIXES = (".json", ".jsonl", ".parquet")
_ANSWER_KEYS = ("chosen", "rejected")
_COPIED = ("id", "images", "image", "videos", "video", "system", "fps")  # top-level keys both conversations keep


def _empty(answer: Any) -> bool:
    if isinstance(answer, dict):
        return _empty(answer.get("value", answer.get("content")))
    return answer is None or (isinstance(answer, (str, list)) and not (answer.strip() if isinstance(answer, str)
                                                                        else answer))


def _conversation(raw: dict, answer: Any, origin: str) -> dict:
    """The SFT-style record of the prompt followed by ``answer``."""
    base = {key: raw[key] for key in _COPIED if key in raw}
    if "conversations" in raw:
        if not isinstance(raw["conversations"], list):
            raise MLLMRecordError(f"{origin}: 'conversations' must be a list")
        turn = answer if isinstance(answer, dict) else {"from": "gpt", "value": answer}
        return {**base, "conversations": [*raw["conversations"], turn]}
    prompt = raw.get("prompt", raw.get("messages"))
    if prompt is None:
        raise MLLMRecordError(f"{origin}: pair has no prompt ('prompt', 'messages' or 'conversations'); keys: "
                              f"{sorted(raw)}")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(prompt, list):
        raise MLLMRecordError(f"{origin}: 'prompt' must be a string or a list of messages")
    turns = ([{"role": "assistant", "content": answer}] if isinstance(answer, str)
             else [answer] if isinstance(answer, dict) else answer)
    return {**base, "messages": [*prompt, *turns]}


def parse_pair(raw: Any, origin: str, image_root: str | os.PathLike, source_dir: str | os.PathLike | None = None,
               media_roots: tuple[str, ...] | list[str] = ()) -> PreferenceRecord:
    """One decoded JSON value as a :class:`PreferenceRecord` (module docstring), or one error naming ``origin``."""
    if not isinstance(raw, dict):
        raise MLLMRecordError(f"{origin}: pair is not a JSON object")
    record_id = raw.get("id")
    record_id = str(record_id) if isinstance(record_id, (str, int)) else None
    for key in _ANSWER_KEYS:
        if _empty(raw.get(key)):
            raise MLLMRecordError(f"{origin}: pair has no {key!r} answer", MISSING_ANSWER, record_id=record_id)
    if raw["chosen"] == raw["rejected"]:
        raise MLLMRecordError(f"{origin}: 'chosen' and 'rejected' are the same answer", IDENTICAL_ANSWERS,
                              record_id=record_id)
    chosen, rejected = (parse_record(_conversation(raw, raw[key], origin), origin, image_root, source_dir=source_dir,
                                     media_roots=media_roots) for key in _ANSWER_KEYS)
    for key, record in (("chosen", chosen), ("rejected", rejected)):
        if record.messages[-1]["role"] != "assistant":
            raise MLLMRecordError(f"{origin}: the {key!r} answer does not end with an assistant turn",
                                  record_id=record_id)
    return PreferenceRecord(chosen.record_id, origin, chosen.messages, rejected=rejected.messages)


def _raw_values(path: Path, name: str, max_bytes: int) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for origin, line in jsonl_lines(path, name, max_bytes):
            yield origin, decode_json_line(line, origin) if isinstance(line, bytes) else line
    elif suffix == ".json":
        yield from iter_json_values(path, name, max_bytes)
    else:
        import pyarrow.parquet as pq

        for index, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{name}:{index}", row


def read_preference_records(path: str | os.PathLike, image_root: str | os.PathLike | None = None, *,
                            on_bad: Callable[[MLLMRecordError], None] | None = None,
                            max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                            media_roots: tuple[str, ...] | list[str] = ()) -> Iterator[PreferenceRecord]:
    """The pairs of one file (``.json`` list, ``.jsonl`` one per line, ``.parquet`` one per row); a bad pair goes to
    ``on_bad`` and reading goes on, or is raised without one. Relative media paths resolve against ``image_root``
    (default: the file's folder)."""
    path = Path(path)
    name = str(path)
    if path.suffix.lower() not in SUFFIXES:
        raise MLLMRecordError(f"{name}: unsupported file type {path.suffix!r} for preference pairs (expected "
                              f"{', '.join(SUFFIXES)})", "invalid_source")
    if not path.is_file():
        raise MLLMRecordError(f"{name}: data file not found", "invalid_source")
    root = os.path.abspath(image_root if image_root is not None else path.parent)
    for origin, raw in _raw_values(path, name, max_record_bytes):
        try:
            if isinstance(raw, MLLMRecordError):
                raise raw
            yield parse_pair(raw, origin, root, source_dir=path.parent, media_roots=media_roots)
        except MLLMRecordError as err:
            if on_bad is None:
                raise
            on_bad(err)
