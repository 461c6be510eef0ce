"""The files a run writes beside its checkpoints: what it trained, which records it left out, how it ended.

Only ``Trainer.run`` writes them (building a ``Trainer`` writes nothing), and only the main process.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import RunState

BAD_RECORDS = "bad_records.jsonl"
DROPPED_RECORDS = "dropped_records.jsonl"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


class RunFiles:
    """The run directory's record files; a resumed run keeps what its position has already reached."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir

    @property
    def bad_records(self) -> Path:
        return self.output_dir / BAD_RECORDS

    @property
    def dropped_records(self) -> Path:
        return self.output_dir / DROPPED_RECORDS

    def make(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)

    def open_metrics(self, state: RunState):
        """``metrics.jsonl`` keeps the lines up to the resumed step (a killed run may have logged past its last
        checkpoint) and is line-buffered, so a kill loses nothing already trained."""
        path = self.output_dir / METRICS
        kept = []
        if state.step and path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= state.step]
        handle = open(path, "w", buffering=1)
        handle.writelines(line + "\n" for line in kept)
        return handle

    def reset_dropped_records(self, state: RunState) -> None:
        """``dropped_records.jsonl`` keeps the epochs the resumed position has already started (a killed run may
        have listed the next one too)."""
        path = self.dropped_records
        started = state.epoch + (1 if state.epoch_steps_done else 0)
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["epoch"] < started] \
            if state.step and path.is_file() else []
        path.write_text("".join(line + "\n" for line in kept))

    def list_dropped_records(self, dataset, micro_batch_size: int | None = None, epoch: int = 0) -> None:
        """Append the epoch's dropped draws (with reasons) beside the summary: a million ids do not belong
        inline. One line per draw, as the per-source tallies count them, with its ``source``'s name: a record a
        ``repeat: 2`` source draws twice and drops is two lines, ``draw`` 0 and 1 (the draws of one record are
        alike, so they are numbered in the record's lines of the epoch). ``bad_records.jsonl`` is kept current as
        faults appear."""
        records, sources = dataset.records, dataset.sources
        dropped = dataset.dropped_records(micro_batch_size, epoch)
        source_of = dataset.source_of([index for index, _ in dropped]).tolist()
        draws = Counter()
        with open(self.dropped_records, "a") as handle:
            for (index, reason), source in zip(dropped, source_of, strict=True):
                record = records[index]
                handle.write(json.dumps({"epoch": epoch, "source": sources[source].name, "origin": record.origin,
                                         "record_id": record.record_id, "draw": draws[index],
                                         "reason": reason}) + "\n")
                draws[index] += 1

    @staticmethod
    @contextmanager
    def written_aside(final: Path) -> Iterator[Path]:
        """A folder written under ``.<name>.partial`` and renamed to ``final`` once complete: a kill during the
        final save leaves the previous folder (or none), never one holding only ``config.json``."""
        partial = final.with_name(f".{final.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)  # left by a kill during an earlier save
        partial.mkdir(parents=True)
        yield partial
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)

    def write_summary(self, summary: dict) -> None:
        with open(self.output_dir / SUMMARY, "w") as handle:
            json.dump(summary, handle, indent=2)
