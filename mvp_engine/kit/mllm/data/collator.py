"""Batching packs (or single samples) into rectangular tensors padded with the inactive values."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .media import OWNER_KEYS, MLLMMediaHandler
from .pack import TOKEN_FIELDS
from .sample import IGNORE_INDEX, TOKEN_FIELD_PADS

# what a ``metadata`` hook adds (``mvp_engine.packing.batch_metadata``): the layout read on the CPU, positions as the
# model takes them
PACKED_METADATA, PACKED_POSITIONS = "packed_metadata", "packed_position_ids"

# Fields of a batch that only the engine reads (segment ids and labels, bookkeeping, media owners, faults in
# transit): never a model kwarg (``mvp_engine.packing`` refuses them), never media to merge.
BATCH_ONLY_FIELDS = frozenset({"labels", "pack_segment_ids", "source_sample_num", "cu_seqlens", "max_seqlen",
                               "media_tokens", "sample_ids", "bad_records", "source_counts", "data_state", *OWNER_KEYS,
                               PACKED_METADATA, PACKED_POSITIONS})
NON_MEDIA_FIELDS = set(TOKEN_FIELDS) | set(TOKEN_FIELD_PADS) | BATCH_ONLY_FIELDS


class MLLMCollator:
    """Pads each row to a common length: ``input_ids`` pad id, ``labels`` -100, ``pack_segment_ids`` -1,
    ``position_ids`` one fresh run 0,1,2,... for the padding, the per-token fields of ``TOKEN_FIELD_PADS`` any row
    carries their inactive value (a row without the field: all of it), and emits batch-level ``cu_seqlens`` over
    the flattened rows in which each row's padding run is a segment of its own.

    The common length is the longest row's, raised to the smallest of ``widths`` that holds it (none: the longest
    row's own), then rounded up to ``pad_to_multiple_of``. ``widths`` keep the batch shapes few where a kernel is
    compiled per shape.

    ``metadata`` (optional) maps the padded batch to more fields, added to it: what a training step would otherwise
    compute from the batch on its device (the engine's packed metadata), computed here on the CPU, in the loader's
    workers. It must be picklable where the loader's workers are spawned.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, widths: Sequence[int] = (),
                 metadata: Callable[[dict], dict] | None = None):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} is invalid: allowed null or an int >= 1")
        if any(not isinstance(width, int) or width < 1 for width in widths):
            raise ValueError(f"widths={list(widths)} is invalid: allowed ints >= 1")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.widths = tuple(sorted(widths))
        self.metadata = metadata

    def padded_length(self, longest: int) -> int:
        multiple = self.pad_to_multiple_of or 1
        longest = next((width for width in self.widths if width >= longest), longest)
        return max(multiple, math.ceil(longest / multiple) * multiple)

    def __call__(self, rows: Sequence[dict]) -> dict:
        width = self.padded_length(max(len(row["input_ids"]) for row in rows))
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "pack_segment_ids": -1}
        fill.update((key, TOKEN_FIELD_PADS[key]) for key in sorted({k for row in rows for k in row
                                                                     if k in TOKEN_FIELD_PADS}))
        batch: dict = {}
        for key, value in fill.items():
            out = torch.full((len(rows), width), value, dtype=torch.long)
            for b, row in enumerate(rows):
                if key in row:
                    out[b, : len(row[key])] = row[key]
            batch[key] = out
        positions = torch.arange(width).repeat(len(rows), 1)
        boundaries = [0]
        for b, row in enumerate(rows):
            n = len(row["position_ids"])
            positions[b, :n] = row["position_ids"]
            positions[b, n:] -= n
            offset = b * width
            boundaries.extend((offset + row["cu_seqlens"][1:].long()).tolist())
            if n < width:
                boundaries.append(offset + width)
        batch["position_ids"] = positions
        cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
        batch["cu_seqlens"] = cu_seqlens
        batch["max_seqlen"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        batch["source_sample_num"] = torch.tensor([row["source_sample_num"] for row in rows], dtype=torch.long)
        batch["media_tokens"] = torch.tensor([row["media_tokens"] for row in rows], dtype=torch.long)
        batch["sample_ids"] = [row["sample_ids"] for row in rows]
        # samples a decoding fault took out of their packs, travelling to the trainer (which may be another process)
        batch["bad_records"] = [bad for row in rows for bad in row.get("bad_records", ())]
        states = [row["data_state"] for row in rows if "data_state" in row]
        if states:  # the stream mode's position after the step the last row ends (stream.py)
            batch["data_state"] = states[-1]
        if all("source_counts" in row for row in rows):  # per-source samples and tokens, summed over the rows
            batch["source_counts"] = torch.stack([row["source_counts"] for row in rows]).sum(0)
        media_keys = sorted({key for row in rows for key in row if key not in NON_MEDIA_FIELDS})
        batch.update(MLLMMediaHandler.merge_batch(rows, media_keys))
        if self.metadata is not None:
            batch.update(self.metadata(batch))
        return batch
