"""Records, encoded samples and their metadata: the units the DataKit moves around."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from .media import MediaKind

IGNORE_INDEX = -100

# Per-token fields a model reads besides the ids (``MLLMSample.token_fields``), with the inactive value the pack
# gives a sample that lacks one and the collator gives padding: 0 = text (``token_type_ids``: 1 on image soft
# tokens; ``mm_token_type_ids``: 1 image, 2 video; ``pair_branch_ids``: a preference pair's prefix 0 / chosen 1 /
# rejected 2, read by the engine's masks and positions only, ``pairs.py``). A new field is one entry here.
TOKEN_FIELD_PADS: dict[str, int] = {"token_type_ids": 0, "mm_token_type_ids": 0, "pair_branch_ids": 0}


@dataclass
class MLLMRecord:
    """One conversation as read from a source, normalised to OpenAI-style messages.

    ``messages`` is a list of ``{"role": "system"|"user"|"assistant", "content": [part, ...]}`` where a part is
    ``{"type": "text", "text": str}``, ``{"type": "image", "path": str}`` or ``{"type": "video", "path": str}``
    (absolute paths; a video part may carry ``"fps"``, the frame rate of a frame folder). ``origin`` names the file
    and line the record came from, so every error about it can point there.
    """

    record_id: str
    origin: str
    messages: list[dict]

    def parts(self, kind: str) -> list[dict]:
        """The record's parts of one type (``"image"``, ``"video"``), in conversation order."""
        return [part for message in self.messages for part in message["content"] if part["type"] == kind]

    @property
    def image_paths(self) -> list[str]:
        return [part["path"] for part in self.parts("image")]

    @property
    def video_paths(self) -> list[str]:
        return [part["path"] for part in self.parts("video")]

    @property
    def media_paths(self) -> list[str]:
        """Every media file (or frame folder) the record names: what a cached measure of it depends on."""
        return self.image_paths + self.video_paths


@dataclass(frozen=True)
class SampleMeta:
    """What planning needs about a sample, obtained without decoding any image or video frame.

    ``num_media`` counts images and videos (a video is one item). ``media_end`` is the token index just past the
    last media placeholder, image or video (0 when text-only): a sample may be
    truncated to ``n`` tokens only when ``media_end <= n``, so truncation never cuts through media tokens.
    ``first_supervised`` is the index of the first supervised token after the first (the first token of a packed
    segment is never a target), ``length`` when there is none: a sample truncated to ``n <= first_supervised``
    tokens trains nothing and is dropped at plan time. 0 (an encoder that does not say) never drops.

    ``media_tokens`` and ``media_sq`` size the sample's vision work for the cost model (``cost.py``) without any
    pixel: the placeholder tokens of all its media items, and the sum over the groups the vision tower attends
    separately (an image: one; a Qwen-style video: one per temporal patch) of the group's tokens squared.
    """

    length: int
    num_media: int = 0
    media_end: int = 0
    first_supervised: int = 0
    media_tokens: int = 0
    media_sq: int = 0


def first_supervised_index(labels: torch.Tensor | np.ndarray) -> int:
    """:attr:`SampleMeta.first_supervised` of a label row (a tensor, or the numpy array the measure pass has)."""
    supervised = np.flatnonzero(np.asarray(labels[1:]) != IGNORE_INDEX)
    return int(supervised[0]) + 1 if supervised.size else len(labels)


@dataclass
class MLLMSample:
    """One encoded conversation: token ids, labels aligned with them (the model shifts), and its media.

    ``media`` maps field names (``pixel_values``, ``image_grid_thw``, ...) to tensors whose first dimension
    runs over this sample's media items or patches; merging a pack concatenates them along that dimension.
    ``token_fields`` maps names of :data:`TOKEN_FIELD_PADS` to 1-D tensors aligned with ``input_ids`` (packed and
    padded like the ids, truncated with them). ``media_kinds``: how to read ``media`` where it holds more than the
    kit's generic fields of a kind (``media.MediaKind.with_fields``: a model's per-item or count field), as the
    encoder declares it; the kit's kinds stand for any kind not named.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    sample_id: str = ""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    num_media: int = 0
    media_tokens: int = 0
    media_end: int = 0
    media_sq: int = 0  # see SampleMeta.media_sq
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    media_kinds: tuple[MediaKind, ...] = ()
    # a preference pair laid out with its prefix duplicated (``pairs.py``): its two conversations, which a pack lays
    # out as two segments of their own; the fields above are the two concatenated (length, media counts)
    parts: tuple[MLLMSample, ...] = ()

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1 or self.labels.shape != self.input_ids.shape:
            raise ValueError(
                f"sample {self.sample_id!r}: input_ids and labels must be 1-D of equal length, got "
                f"{tuple(self.input_ids.shape)} and {tuple(self.labels.shape)}"
            )
        for name, values in self.token_fields.items():
            if name not in TOKEN_FIELD_PADS:
                raise ValueError(f"sample {self.sample_id!r}: token field {name!r} has no inactive value; add it to "
                                 f"TOKEN_FIELD_PADS (known: {sorted(TOKEN_FIELD_PADS)})")
            if values.shape != self.input_ids.shape:
                raise ValueError(f"sample {self.sample_id!r}: token field {name!r} has shape {tuple(values.shape)}, "
                                 f"input_ids {tuple(self.input_ids.shape)}")

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    @property
    def supervised_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def meta(self) -> SampleMeta:
        return SampleMeta(self.length, self.num_media, self.media_end, first_supervised_index(self.labels),
                          self.media_tokens, self.media_sq)

    def truncated(self, max_len: int) -> MLLMSample:
        """Cut text tokens past ``max_len``; refuses to cut through media placeholders."""
        if self.media_end > max_len:
            raise ValueError(
                f"sample {self.sample_id!r}: cannot truncate to {max_len} tokens, media tokens run to "
                f"{self.media_end}"
            )
        return MLLMSample(
            input_ids=self.input_ids[:max_len],
            labels=self.labels[:max_len],
            sample_id=self.sample_id,
            media=self.media,
            num_media=self.num_media,
            media_tokens=self.media_tokens,
            media_end=self.media_end,
            media_sq=self.media_sq,
            token_fields={name: values[:max_len] for name, values in self.token_fields.items()},
            media_kinds=self.media_kinds,
        )


def measure_each(encoder: MLLMSampleEncoder, records: list[MLLMRecord]) -> list[SampleMeta | Exception]:
    """``encoder.measure`` of each record, or the bad record's error (``MLLMRecordError``) in its place: what an
    encoder's optional ``measure_batch`` returns."""
    from .sources import MLLMRecordError

    metas: list[SampleMeta | Exception] = []
    for record in records:
        try:
            metas.append(encoder.measure(record))
        except MLLMRecordError as err:
            metas.append(err)
    return metas


@runtime_checkable
class MLLMSampleEncoder(Protocol):
    """What a recipe implements to turn records into samples.

    ``measure`` must return exactly the length and media count that ``encode`` will produce, reading image
    sizes from file headers only, so that a whole epoch can be planned without decoding an image. An encoder may
    also have ``measure_batch(records)``, returning what :func:`measure_each` does (the measure pass then hands it
    a batch of records at once, e.g. to tokenize them in one call).
    """

    def encode(self, record: MLLMRecord) -> MLLMSample: ...

    def measure(self, record: MLLMRecord) -> SampleMeta: ...
