"""Merging per-sample media into a pack and packs into a batch, remembering which segment owns each item."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sample import MLLMSample


class MLLMMediaHandler:
    """Concatenates media along dim 0 and records each media item's segment (and, in a batch, its row).

    Two layouts are seen in practice and both merge by concatenation: flattened patches plus a grid per item
    (Qwen2-VL: ``pixel_values`` ``[patches, D]`` with ``image_grid_thw`` ``[items, 3]``) and stacked images
    (LLaVA: ``pixel_values`` ``[items, C, H, W]``). ``grid_key`` names the per-item grid of the first layout;
    when a sample has it, the patch rows must equal the sum of the grids' products, otherwise every media
    tensor must have one row per item. Recipes need the segment of each item for per-segment positions.
    """

    def __init__(self, grid_key: str = "image_grid_thw", patch_key: str = "pixel_values"):
        self.grid_key = grid_key
        self.patch_key = patch_key

    def validate(self, sample: MLLMSample) -> None:
        media = sample.media
        if sample.num_media == 0:
            if media:
                raise ValueError(f"sample {sample.sample_id!r}: num_media=0 but media fields {sorted(media)} given")
            return
        grid = media.get(self.grid_key)
        for key, value in media.items():
            rows = value.shape[0]
            if grid is not None and key == self.patch_key:
                expected = int(grid.prod(dim=-1).sum())
            else:
                expected = sample.num_media
            if rows != expected:
                raise ValueError(f"sample {sample.sample_id!r}: media field {key!r} has {rows} rows, expected "
                                 f"{expected} ({sample.num_media} media items)")

    def merge_pack(self, samples: Sequence[MLLMSample]) -> dict[str, torch.Tensor]:
        """Media of one pack, plus ``media_segment_ids`` (the segment of each media item)."""
        keys: list[str] = []
        for sample in samples:
            self.validate(sample)
            if sample.num_media and not keys:
                keys = sorted(sample.media)
            elif sample.num_media and sorted(sample.media) != keys:
                raise ValueError(f"sample {sample.sample_id!r}: media fields {sorted(sample.media)} differ from "
                                 f"the pack's {keys}")
        merged = {key: torch.cat([s.media[key] for s in samples if s.num_media]) for key in keys}
        merged["media_segment_ids"] = torch.repeat_interleave(
            torch.arange(len(samples), dtype=torch.long),
            torch.tensor([s.num_media for s in samples], dtype=torch.long),
        )
        return merged

    @staticmethod
    def merge_batch(rows: Sequence[dict], media_keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Media of a batch of packs, in row-major order, plus ``media_batch_index`` (the row of each item)."""
        merged = {key: torch.cat([row[key] for row in rows if key in row]) for key in media_keys}
        segment_ids = [row["media_segment_ids"] for row in rows]
        merged["media_segment_ids"] = torch.cat(segment_ids)
        merged["media_batch_index"] = torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.long), torch.tensor([len(s) for s in segment_ids], dtype=torch.long)
        )
        return merged
