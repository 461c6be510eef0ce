"""A pack: several samples laid end to end in one row, with the metadata that keeps them apart."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .media import MLLMMediaHandler
from .pairs import BRANCH_FIELD, branch_positions
from .sample import IGNORE_INDEX, TOKEN_FIELD_PADS, MLLMSample

TOKEN_FIELDS = ("input_ids", "labels", "pack_segment_ids", "position_ids")


def sample_positions(sample: MLLMSample) -> torch.Tensor:
    """A sample's positions: 0, 1, ... along it; a preference pair's continuations both continue from its prefix."""
    branches = sample.token_fields.get(BRANCH_FIELD)
    return torch.arange(sample.length) if branches is None else branch_positions(branches)


@dataclass
class MLLMPack:
    """Samples sharing one row. An empty pack is a legal all-padding row (``source_sample_num`` 0)."""

    samples: list[MLLMSample]
    media_handler: MLLMMediaHandler = field(default_factory=MLLMMediaHandler)

    @property
    def source_sample_num(self) -> int:
        return len(self.samples)

    @property
    def length(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def segments(self) -> list[MLLMSample]:
        """What the row holds one segment each: every sample, a preference pair with its prefix duplicated as its
        two conversations (``MLLMSample.parts``)."""
        return [part for s in self.samples for part in (s.parts or (s,))]

    def to_model_inputs(self) -> dict:
        """Flat per-pack fields: token fields of the pack's length, segment boundaries and merged media.

        The first label of every segment is ignored so no sample learns to predict the next one's first token.
        """
        segments = self.segments
        lengths = torch.tensor([s.length for s in segments], dtype=torch.long)
        if segments:
            input_ids = torch.cat([s.input_ids for s in segments]).long()
            labels = torch.cat([s.labels for s in segments]).long().clone()
        else:
            input_ids = labels = torch.zeros(0, dtype=torch.long)
        cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        labels[cu_seqlens[:-1].long()] = IGNORE_INDEX
        inputs = {
            "input_ids": input_ids,
            "labels": labels,
            "pack_segment_ids": torch.repeat_interleave(torch.arange(len(segments)), lengths),
            "position_ids": torch.cat([sample_positions(s) for s in segments]) if segments
            else torch.zeros(0, dtype=torch.long),
            "source_sample_num": len(self.samples),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int(lengths.max()) if segments else 0,
            "media_tokens": sum(s.media_tokens for s in self.samples),
            "sample_ids": [s.sample_id for s in self.samples],
        }
        inputs.update(self.token_fields())
        inputs.update(self.media_handler.merge_pack(segments))
        return inputs

    def token_fields(self) -> dict[str, torch.Tensor]:
        """Every ``token_fields`` entry any segment carries, concatenated; a segment without it gets the field's
        inactive value (``TOKEN_FIELD_PADS``)."""
        segments = self.segments
        names = sorted({name for s in segments for name in s.token_fields})
        return {name: torch.cat([s.token_fields[name].long() if name in s.token_fields
                                 else torch.full((s.length,), TOKEN_FIELD_PADS[name], dtype=torch.long)
                                 for s in segments]) for name in names}
