"""A synthetic encoder for kit tests: records state their own length and media, no model or image involved."""

from __future__ import annotations

import torch

from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMRecord, MLLMRecordError, MLLMSample, SampleMeta

PATCH_DIM = 4


def fake_record(index: int, length: int, media: int = 0, fault: str | None = None) -> MLLMRecord:
    """``fault``: ``measure`` (an unreadable image header) or ``decode`` (a corrupt image body) makes the record
    fail at that stage, as real broken records do."""
    text = f"{length} {media}" + (f" {fault}" if fault else "")
    return MLLMRecord(record_id=f"r{index}", origin=f"fake.jsonl:{index + 1}",
                      messages=[{"role": "user", "content": [{"type": "text", "text": text}]}])


class FakeEncoder:
    """Deterministic tokens; media items of 2x2 patches at the start; every other token supervised."""

    @staticmethod
    def _fields(record: MLLMRecord) -> tuple[int, int, str]:
        length, media, *fault = record.messages[0]["content"][0]["text"].split()
        return int(length), int(media), fault[0] if fault else ""

    def measure(self, record: MLLMRecord) -> SampleMeta:
        length, media, fault = self._fields(record)
        if fault == "measure":
            raise MLLMRecordError(f"{record.origin}: cannot read image header", "unreadable_image",
                                  record_id=record.record_id)
        # every other token is supervised from index 1 (see encode)
        return SampleMeta(length=length, num_media=media, media_end=min(length, 4 * media),
                          first_supervised=1 if length > 1 else length, media_tokens=min(length, 4 * media),
                          media_sq=16 * media)

    def encode(self, record: MLLMRecord) -> MLLMSample:
        meta = self.measure(record)
        if self._fields(record)[2] == "decode":
            raise MLLMRecordError(f"{record.origin}: cannot load image: truncated", "corrupt_image",
                                  record_id=record.record_id)
        seed = int(record.record_id[1:])
        input_ids = (torch.arange(meta.length) * 7 + seed) % 1000 + 1
        labels = input_ids.clone()
        labels[::2] = IGNORE_INDEX
        media = {}
        if meta.num_media:
            media = {
                "pixel_values": torch.full((4 * meta.num_media, PATCH_DIM), float(seed)),
                "image_grid_thw": torch.tensor([[1, 2, 2]] * meta.num_media),
            }
        return MLLMSample(input_ids=input_ids, labels=labels, sample_id=record.record_id, media=media,
                          num_media=meta.num_media, media_tokens=meta.media_tokens, media_end=meta.media_end,
                          media_sq=meta.media_sq)


def packed_segments_and_labels(lengths_per_row, width: int, vocab: int, seed: int = 0):
    """Segment ids and labels of packed rows (``-1`` / ignored past the samples): each sample's first token
    unsupervised, the rest random targets below ``vocab``."""
    gen = torch.Generator().manual_seed(seed)
    seg = torch.full((len(lengths_per_row), width), -1)
    labels = torch.full((len(lengths_per_row), width), IGNORE_INDEX)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for s, n in enumerate(lengths):
            seg[r, start:start + n] = s
            labels[r, start + 1:start + n] = torch.randint(0, vocab, (n - 1,), generator=gen)
            start += n
    return seg, labels
