"""The bad-record policy: every record that cannot be used is either one clear error or a counted, reported drop.

Real instruction-tuning sets always carry broken records. Under ``data.on_bad_record=skip`` each one is left out
with its fault class (``reason``), counted, and listed in the report (``bad_records.jsonl`` in the run directory:
origin ``file:line``, id, reason, stage, message), every one of them and not just the first; the run stops with one
line once more than ``data.max_bad_fraction`` of the records read are bad. Under ``error`` the first bad record
stops the run, as one line.

Faults are found at three stages: ``read`` (JSON and record structure, missing image files), ``measure`` (image
headers, the image processor's size limits, the chat template) and ``decode`` (an image body that is corrupt or a
decompression bomb, found only when a pack is encoded). The first two are known before training, so the plan and
the step count already leave those records out; a ``decode`` fault takes the sample out of its pack, which is still
served (so ranks stay in step) and carries the fault to the trainer in the batch's ``bad_records`` field.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from .sources import MLLMRecordError

STAGES = ("read", "measure", "decode")


class TooManyBadRecords(ValueError):
    """More bad records than ``data.max_bad_fraction`` allows, or any under ``on_bad_record=error``."""


@dataclass(frozen=True)
class BadRecord:
    origin: str
    record_id: str | None
    reason: str
    stage: str
    message: str

    @classmethod
    def from_error(cls, err: MLLMRecordError, stage: str) -> BadRecord:
        origin = str(err).split(": ", 1)[0]
        return cls(origin, getattr(err, "record_id", None), getattr(err, "reason", "invalid_record"), stage,
                   str(err))

    def to_dict(self) -> dict:
        return asdict(self)


class BadRecordReport:
    """All bad records of a run, once each (a record failing again in a later epoch is not listed twice)."""

    def __init__(self, policy: str = "skip", max_fraction: float = 0.01):
        self.policy = policy
        self.max_fraction = max_fraction
        self.records: dict[str, BadRecord] = {}
        self.records_read = 0  # good + bad records of the sources, counted by the reader

    def add(self, bad: BadRecord) -> bool:
        """Record ``bad``; True when it was new."""
        if bad.origin in self.records:
            return False
        self.records[bad.origin] = bad
        return True

    def add_error(self, err: MLLMRecordError, stage: str) -> None:
        """The reader's / measurer's hook: under ``error`` the record stops the run, else it is recorded."""
        if self.policy == "error":
            raise err
        self.add(BadRecord.from_error(err, stage))

    @property
    def count(self) -> int:
        return len(self.records)

    def counts(self, stage: str | None = None) -> Counter:
        return Counter(b.reason for b in self.records.values() if stage is None or b.stage == stage)

    def fraction(self) -> float:
        return self.count / self.records_read if self.records_read else 0.0

    def check(self, report_path: Path | str | None, scope: str = "") -> None:
        """Stop (one line, starting with ``scope``: which data it is about) when the bad fraction exceeds the limit,
        or on any bad record under ``error``. The line points to ``report_path``, the file listing them all, or
        without one names the first bad record."""
        first = next(iter(self.records.values()), None)
        prefix = f"{scope}: " if scope else ""
        if first is not None and self.policy == "error":
            raise TooManyBadRecords(f"{prefix}data.on_bad_record=error: {first.message} ({first.reason})")
        if self.fraction() > self.max_fraction:
            listed = f"every one is listed in {report_path}" if report_path else f"the first: {first.message}"
            raise TooManyBadRecords(
                f"{prefix}{self.count} of {self.records_read} records are bad ({self.fraction():.1%} > "
                f"data.max_bad_fraction={self.max_fraction}): by reason {dict(self.counts().most_common())}; "
                f"{listed}; fix them or raise data.max_bad_fraction")

    def write(self, path: Path | str) -> None:
        with open(path, "w") as handle:
            for bad in self.records.values():
                handle.write(json.dumps(bad.to_dict()) + "\n")
