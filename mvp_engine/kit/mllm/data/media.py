"""Merging per-sample media into a pack and packs into a batch, remembering which segment owns each item."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .sample import MLLMSample


@dataclass(frozen=True)
class MediaKind:
    """One kind of media item in ``MLLMSample.media``: the field holding its pixels, its per-item grid field (when
    the layout has one), the batch fields naming each item's segment and row, ``item_keys``: fields with one row
    per item (a clip's seconds per temporal patch, a stacked image's patch positions), ``count_key``: the
    stacked rows of each item where an item is several of them (tiles per image), and ``tower``: the kind whose
    media encoder this kind's items run through (None: its own; :meth:`on_tower_of`).

    The kit's kinds (:data:`IMAGES`, :data:`VIDEOS`) carry the generic fields only: a model's own per-item or count
    fields are its recipe's to declare (:meth:`with_fields`), on its encoder, whose samples carry the kinds
    (``MLLMSample.media_kinds``)."""

    name: str
    patch_key: str
    grid_key: str
    segment_key: str
    row_key: str
    item_keys: tuple[str, ...] = ()
    count_key: str | None = None
    tower: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return self.patch_key, self.grid_key, *self.item_keys, *((self.count_key,) if self.count_key else ())

    @property
    def tower_name(self) -> str:
        """The media encoder this kind runs through, named by the kind that owns it."""
        return self.tower or self.name

    def with_fields(self, item_keys: tuple[str, ...] = (), count_key: str | None = None) -> MediaKind:
        """This kind with a model's own fields added: ``item_keys`` (one row per item) and a ``count_key``."""
        return replace(self, item_keys=(*self.item_keys, *item_keys), count_key=count_key or self.count_key)

    def on_tower_of(self, other: MediaKind) -> MediaKind:
        """This kind, declared to run through ``other``'s media encoder with no parameter of its own (a model
        whose videos go through its image tower): a micro-batch holding either kind then gives every parameter of
        that encoder a gradient, so the engine runs no dummy pass for the other (``participation.dummy_passes``)."""
        return replace(self, tower=other.tower_name)


IMAGES = MediaKind("image", "pixel_values", "image_grid_thw", "media_segment_ids", "media_batch_index")
VIDEOS = MediaKind("video", "pixel_values_videos", "video_grid_thw", "video_segment_ids", "video_batch_index")
MEDIA_KINDS = (IMAGES, VIDEOS)
OWNER_KEYS = frozenset(key for kind in MEDIA_KINDS for key in (kind.segment_key, kind.row_key))


def sample_kinds(sample: MLLMSample) -> tuple[MediaKind, ...]:
    """The kinds that say how to read ``sample.media``: the kit's, each replaced by the sample's own declaration of
    it (``MLLMSample.media_kinds``, its encoder's)."""
    declared = {kind.name: kind for kind in sample.media_kinds}
    return tuple(declared.get(kind.name, kind) for kind in MEDIA_KINDS)


class MLLMMediaHandler:
    """Concatenates media along dim 0, kind by kind, and records each item's segment (and, in a batch, its row).

    Two layouts are seen in practice and both merge by concatenation: flattened patches plus a grid per item
    (Qwen2-VL: ``pixel_values`` ``[patches, D]`` with ``image_grid_thw`` ``[items, 3]``; its videos likewise in
    ``pixel_values_videos`` / ``video_grid_thw``) and stacked images (LLaVA: ``pixel_values`` ``[items, C, H, W]``;
    Gemma 4: pre-patchified ``[items, max_patches, D]`` with a per-item field of patch positions; InternVL:
    ``[tiles, C, H, W]`` with a count field ``[items]``, the tiles of each image).
    With a grid, the patch rows must equal the sum of the grids' products and the items are the grid's rows; with
    counts, the rows must equal their sum and the items are the counts' rows; else the items are the patch rows.
    A sample's items of all kinds add up to its ``num_media``. Which fields a sample may carry is what its kinds say
    (:func:`sample_kinds`): the kit's generic ones and those its encoder declares; any other is refused.
    Samples may carry different kinds (an image sample next to a video sample); those carrying the same kind carry
    the same fields for it, read by the same declaration. Recipes need the segment of each item for per-segment
    positions: ``media_segment_ids`` for images, ``video_segment_ids`` for videos, each in its kind's item order.
    """

    def items(self, sample: MLLMSample, kind: MediaKind) -> int:
        """Items of ``kind`` the sample carries, its fields checked against each other."""
        media = sample.media
        if kind.patch_key not in media:
            if kind.grid_key in media:
                raise ValueError(f"sample {sample.sample_id!r}: media field {kind.grid_key!r} without "
                                 f"{kind.patch_key!r}")
            return 0
        rows = media[kind.patch_key].shape[0]
        items = rows if kind.grid_key not in media else media[kind.grid_key].shape[0]  # a grid row per item
        for key in kind.item_keys:
            if key in media and media[key].shape[0] != items:
                raise ValueError(f"sample {sample.sample_id!r}: media field {key!r} has {media[key].shape[0]} rows, "
                                 f"expected one per item ({items})")
        counts = media.get(kind.count_key) if kind.count_key else None
        if counts is not None:
            if rows != int(counts.sum()):
                raise ValueError(f"sample {sample.sample_id!r}: media field {kind.patch_key!r} has {rows} rows, "
                                 f"expected {int(counts.sum())} (the sum of {kind.count_key!r})")
            return counts.shape[0]
        grid = media.get(kind.grid_key)
        if grid is None:
            return rows
        expected = int(grid.prod(dim=-1).sum())
        if rows != expected:
            raise ValueError(f"sample {sample.sample_id!r}: media field {kind.patch_key!r} has {rows} rows, expected "
                             f"{expected} (the patches of its {grid.shape[0]} grid(s))")
        return grid.shape[0]

    def validate(self, sample: MLLMSample) -> None:
        kinds = sample_kinds(sample)
        known = {key for kind in kinds for key in kind.keys}
        unknown = sorted(set(sample.media) - known)
        if unknown:
            raise ValueError(f"sample {sample.sample_id!r}: media fields {unknown} are not known media fields "
                             f"{sorted(known)} (a model's own field is declared on its encoder's media kinds)")
        items = sum(self.items(sample, kind) for kind in kinds)
        if items != sample.num_media:
            raise ValueError(f"sample {sample.sample_id!r}: media fields hold {items} items, expected "
                             f"{sample.num_media} (num_media)")

    def merge_pack(self, samples: Sequence[MLLMSample]) -> dict[str, torch.Tensor]:
        """Media of one pack, plus each kind's ``segment_key`` (the segment of each of its items)."""
        for sample in samples:
            self.validate(sample)
        merged: dict[str, torch.Tensor] = {}
        for kind in self._pack_kinds(samples):
            carriers = [s for s in samples if kind.patch_key in s.media]
            fields = sorted(set(carriers[0].media) & set(kind.keys)) if carriers else []
            for sample in carriers:
                if sorted(set(sample.media) & set(kind.keys)) != fields:
                    raise ValueError(f"sample {sample.sample_id!r}: media fields "
                                     f"{sorted(set(sample.media) & set(kind.keys))} differ from the pack's {fields}")
            merged.update({key: torch.cat([s.media[key] for s in carriers]) for key in fields})
            merged[kind.segment_key] = torch.repeat_interleave(
                torch.arange(len(samples), dtype=torch.long),
                torch.tensor([self.items(s, kind) for s in samples], dtype=torch.long),
            )
        return merged

    @staticmethod
    def _pack_kinds(samples: Sequence[MLLMSample]) -> tuple[MediaKind, ...]:
        """One declaration per kind for the whole pack: the samples that carry a kind read it the same way."""
        kinds = {kind.name: kind for kind in MEDIA_KINDS}
        owner: dict[str, str] = {}
        for sample in samples:
            for kind in sample_kinds(sample):
                if kind.patch_key not in sample.media:
                    continue
                if kind.name in owner and kind != kinds[kind.name]:
                    raise ValueError(f"sample {sample.sample_id!r}: its {kind.name} fields {list(kind.keys)} differ "
                                     f"from those of sample {owner[kind.name]!r} in the pack "
                                     f"{list(kinds[kind.name].keys)}")
                kinds[kind.name] = kind
                owner.setdefault(kind.name, sample.sample_id)
        return tuple(kinds.values())

    @staticmethod
    def merge_batch(rows: Sequence[dict], media_keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Media of a batch of packs, in row-major order, plus each kind's ``row_key`` (the row of each item)."""
        merged = {key: torch.cat([row[key] for row in rows if key in row]) for key in media_keys}
        for kind in MEDIA_KINDS:
            segment_ids = [row.get(kind.segment_key, torch.zeros(0, dtype=torch.long)) for row in rows]
            merged[kind.segment_key] = torch.cat(segment_ids)
            merged[kind.row_key] = torch.repeat_interleave(
                torch.arange(len(rows), dtype=torch.long), torch.tensor([len(s) for s in segment_ids], dtype=torch.long)
            )
        return merged
