"""A sample encoder built on a tokenizer's chat template: the part of every recipe's encoder that is not the model.

``ChatTemplateEncoder`` renders a record's messages with the tokenizer's chat template, expands the i-th image (and
video) placeholder to the number of tokens the model emits for the i-th image (video), and supervises only assistant
turns: the assistant's content and the template's turn-end marker, never the role header that opens the turn nor the
placeholder (or any other ``unsupervised_tokens``). Supervised character spans come from rendering growing
prefixes of the conversation, so the template must be prefix-stable (rendering the first k messages gives a prefix
of rendering them all); a template that is not is refused with a clear error.

``encode`` and ``measure`` share one layout function and differ only in where the per-medium token counts come
from: ``encode_images`` / ``encode_videos`` (the processors, on decoded pixels) or ``image_token_count`` /
``video_token_count`` (the image size read from the file header; the video's :class:`VideoInfo`, read from its
container or frame folder, nothing decoded). Both read media through the kit's helpers (EXIF rotation applied on
both sides, the same video metadata), so the counts agree; a video that then decodes fewer frames than its header
promised is a bad record (``video_measure_mismatch``), not a wrong plan. Every error names ``record.origin``.

A recipe subclasses it and sets ``image_token``, ``assistant_header``, ``turn_end``, ``unsupervised_tokens`` and
implements the image hooks; a recipe that takes video also sets ``video_token`` and implements the video hooks
(without them a record with a video is a bad record, ``unsupported_video``). By default a video stands in the text
as its placeholder repeated (Qwen2-VL); a model that lays a video out as text and placeholder runs (Qwen3-VL: a
timestamp and a ``<|vision_start|>...<|vision_end|>`` run per frame) sets ``video_part`` (what its chat template
renders per video, replaced whole) and overrides ``video_text(info, tokens)``, which both ``encode`` and ``measure``
call, so the text tokens it adds are counted exactly. Images likewise: a model whose processor writes more than the
placeholder repeated (Gemma: ``<start_of_image>`` becomes ``\n\n<start_of_image>``, the soft tokens,
``<end_of_image>\n\n``) sets ``image_part`` and overrides ``image_text(tokens)``. ``token_type_field`` (e.g.
``token_type_ids``) makes ``encode`` emit that per-token field as transformers' ``create_mm_token_type_ids`` does:
0 text, 1 image placeholder, 2 video placeholder. ``image_kind`` / ``video_kind`` say how to read the media fields
the hooks write (the kit's :data:`IMAGES` / :data:`VIDEOS`; a model with a per-item or count field of its own
declares it with ``MediaKind.with_fields``): every sample carries them (``MLLMSample.media_kinds``), so the DataKit
merges those fields per item and the engine hands them to the model. The processor it is built from needs
``.tokenizer`` and ``.token_id(token)``; its ``video_processor`` (if any) goes into the fingerprint by ``repr``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError
from PIL import Image

from .images import load_image, read_image_size
from .media import IMAGES, VIDEOS, MediaKind
from .sample import IGNORE_INDEX, MLLMRecord, MLLMSample, SampleMeta, first_supervised_index, measure_each
from .sources import MLLMRecordError
from .store import digest
from .video import VideoInfo, read_video_info

ROLES = ("system", "user", "assistant")
# bad-record reasons per media kind
REJECTED = {"image": "image_rejected", "video": "video_rejected"}
TOKEN_MISMATCH = {"image": "image_token_mismatch", "video": "video_token_mismatch"}


class ChatTemplateEncoder:
    """Implements ``MLLMSampleEncoder`` over a chat template; subclasses supply the model-specific hooks."""

    image_token: str = "<image>"
    video_token: str | None = None  # the placeholder the chat template renders per video; None: no video
    video_part: str | None = None  # the template's text per video that ``video_text`` replaces; None: video_token
    image_part: str | None = None  # the template's text per image that ``image_text`` replaces; None: image_token
    token_type_field: str | None = None  # a per-token modality field to emit (``TOKEN_FIELD_PADS``); None: none
    image_kind: MediaKind = IMAGES  # how to read the media fields ``encode_images`` writes
    video_kind: MediaKind = VIDEOS  # and those ``encode_videos`` writes
    measure_version: int = 2  # bump when ``measure`` counts differently: it invalidates every measure cache
    assistant_header: str = ""
    turn_end: str = ""
    unsupervised_tokens: tuple[str, ...] = ()

    def __init__(self, processor: Any):
        if not self.assistant_header or not self.turn_end:
            raise TypeError(f"{type(self).__name__} must set assistant_header and turn_end")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = processor.token_id(self.image_token)
        self.video_token_id = processor.token_id(self.video_token) if self.video_token else None
        # (kind, placeholder, its id) of every medium the recipe takes, in the order counts are passed around
        self._placeholders = [("image", self.image_token, self.image_token_id)]
        if self.video_token:
            self._placeholders.append(("video", self.video_token, self.video_token_id))
        self._placeholder_ids = np.asarray([token_id for _, _, token_id in self._placeholders], dtype=np.int64)
        # what the template renders per medium, replaced by the medium's text
        self._parts = {self.image_part or self.image_token: "image"}
        if self.video_token:
            self._parts[self.video_part or self.video_token] = "video"
        self._placeholder_split = re.compile("|".join(re.escape(part) for part in self._parts))
        self._unsupervised_ids = np.asarray(
            [*self._placeholder_ids.tolist(), *(processor.token_id(token) for token in self.unsupervised_tokens)],
            dtype=np.int64)
        self._special_tokens = sorted(set(self.tokenizer.all_special_tokens))

    @property
    def media_names(self) -> tuple[str, ...]:
        """The media kinds (``MediaKind.name``) this encoder feeds: ``image``, and ``video`` where it sets a
        ``video_token``. The engine runs dummy media passes for these kinds only (``participation.media_kinds``)."""
        return tuple(kind for kind, _, _ in self._placeholders)

    @property
    def media_kinds(self) -> tuple[MediaKind, ...]:
        """The kinds this encoder feeds (``media_names``), as its hooks write their fields: on every sample, and
        what the engine encodes and splits by (``participation.media_kinds``)."""
        return tuple(self.image_kind if name == IMAGES.name else self.video_kind for name in self.media_names)

    # --------------------------------------------------------------------------------------------------- hooks

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Media fields of the sample (first dim over its images or patches) and each image's token count."""
        raise NotImplementedError

    def image_token_count(self, width: int, height: int) -> int:
        """The token count ``encode_images`` gives an image of this (upright) size, computed without pixels."""
        raise NotImplementedError

    def encode_videos(self, videos: list[VideoInfo]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Media fields of the sample's videos (their frames decoded here) and each video's token count; a video
        that does not decode as its metadata says raises :class:`MLLMRecordError` with its reason."""
        raise NotImplementedError

    def video_token_count(self, info: VideoInfo) -> int:
        """The token count ``encode_videos`` gives this video, computed from its metadata alone."""
        raise NotImplementedError

    def image_text(self, tokens: int) -> str:
        """The text that replaces one image's ``image_part``, holding exactly ``tokens`` placeholders; the default
        is the placeholder ``tokens`` times."""
        return self.image_token * tokens

    def video_text(self, info: VideoInfo, tokens: int) -> str:
        """The text that replaces one video's ``video_part`` in the rendered template, holding exactly ``tokens``
        placeholders (from ``encode_videos`` when encoding, ``video_token_count`` when measuring); the default is
        the placeholder ``tokens`` times. Raise ``ValueError`` for a video the layout cannot hold."""
        return self.video_token * tokens

    # -------------------------------------------------------------------------------------------------- public

    def fingerprint(self) -> str:
        """What ``measure`` depends on, hashed (the measure cache's key): the encoder class and its counting
        version, its layout tokens and simple settings, the tokenizer (vocabulary, merges, special tokens, chat
        template) and the image processor's settings (min/max pixels, patch size, ...)."""
        tokenizer = self.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        settings = {key: value for key, value in vars(self).items()
                    if isinstance(value, (bool, int, float, str, tuple)) and not key.startswith("_")}
        processor = self.processor.image_processor
        return digest({
            "encoder": f"{type(self).__module__}.{type(self).__qualname__}",
            "measure_version": self.measure_version,
            "layout": [self.image_token, self.video_token, self.assistant_header, self.turn_end,
                       list(self.unsupervised_tokens), *([self.video_part] if self.video_part else []),
                       *([self.image_part] if self.image_part else []), self.token_type_field],
            "settings": settings,
            "tokenizer": [type(tokenizer).__name__, backend.to_str() if backend is not None else
                          sorted(tokenizer.get_vocab().items()), tokenizer.chat_template,
                          sorted(tokenizer.all_special_tokens)],
            "image_processor": [type(processor).__name__,
                                processor.to_dict() if hasattr(processor, "to_dict") else repr(processor)],
            "video_processor": repr(getattr(self.processor, "video_processor", None)),
        })

    def encode(self, record: MLLMRecord) -> MLLMSample:
        self._validate(record)
        images = [self._load_image(record, path) for path in record.image_paths]
        videos = [self._video_info(record, part) for part in record.parts("video")]
        media, image_counts = self._encode_media(record, "image", self.encode_images, images)
        video_media, video_counts = self._encode_media(record, "video", self.encode_videos, videos)
        media.update(video_media)
        counts = {"image": image_counts, "video": video_counts}
        ids, labels = self._layout(record, counts, videos)
        input_ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
        return MLLMSample(
            input_ids=input_ids,
            labels=labels,
            sample_id=record.record_id,
            media=media,
            num_media=len(image_counts) + len(video_counts),
            media_tokens=sum(image_counts) + sum(video_counts),
            media_end=self._media_end(ids),
            media_sq=self._media_sq(counts, videos),
            token_fields=self._token_types(input_ids),
            media_kinds=self.media_kinds,
        )

    def measure(self, record: MLLMRecord) -> SampleMeta:
        [meta] = self._measure_batch([record])
        if isinstance(meta, MLLMRecordError):
            raise meta
        return meta

    def measure_batch(self, records: list[MLLMRecord]) -> list[SampleMeta | MLLMRecordError]:
        """``measure`` of each record, or the bad record's error in its place. The measure pass calls this per
        batch of rows: their texts are tokenized in one tokenizer call, not one call each (a call costs about as
        much in ``transformers`` as the fast tokenizer's own work on a record's text). An encoder whose ``measure``
        is its own (a subclass's, or one set on the instance) is asked record by record."""
        if getattr(self.measure, "__func__", None) is not ChatTemplateEncoder.measure:
            return measure_each(self, records)
        return self._measure_batch(records)

    def _measure_batch(self, records: list[MLLMRecord]) -> list[SampleMeta | MLLMRecordError]:
        """:meth:`measure_batch` by this class's own measure."""
        texts: list = []
        for record in records:
            try:
                texts.append(self._measured_text(record))
            except MLLMRecordError as err:
                texts.append(err)
        tokenized = iter(self._tokenize([text[0] for text in texts if not isinstance(text, MLLMRecordError)]))
        metas: list[SampleMeta | MLLMRecordError] = []
        for record, text in zip(records, texts):
            if isinstance(text, MLLMRecordError):
                metas.append(text)
                continue
            full, spans, counts, videos = text
            try:
                input_ids, labels = self._labelled(record, counts, *next(tokenized), spans)
            except MLLMRecordError as err:
                metas.append(err)
                continue
            metas.append(SampleMeta(length=len(input_ids), num_media=len(counts["image"]) + len(counts["video"]),
                                    media_end=self._media_end(input_ids),
                                    first_supervised=first_supervised_index(labels),
                                    media_tokens=sum(counts["image"]) + sum(counts["video"]),
                                    media_sq=self._media_sq(counts, videos)))
        return metas

    def layout(self, record: MLLMRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids and labels ``encode`` gives ``record``, from text and media headers alone (no pixel): what
        a preference pair's encoder (``pairs.PairEncoder``) compares its two conversations by."""
        full, spans, counts, _ = self._measured_text(record)
        [(ids, offsets)] = self._tokenize([full])
        input_ids, labels = self._labelled(record, counts, ids, offsets, spans)
        return torch.from_numpy(input_ids), torch.from_numpy(labels)

    # ------------------------------------------------------------------------------------------------- helpers

    def _measured_text(self, record: MLLMRecord):
        """The rendered text, assistant spans, media token counts and videos of ``record``, from text and media
        headers alone."""
        self._validate(record)
        videos = [self._video_info(record, part) for part in record.parts("video")]
        counts = {"image": [self._header_token_count(record, path) for path in record.image_paths],
                  "video": [self._metadata_token_count(record, info) for info in videos]}
        return (*self._text(record, counts, videos), counts, videos)

    def _validate(self, record: MLLMRecord) -> None:
        if not isinstance(record.messages, list) or not record.messages:
            raise self._bad(record, "has no messages")
        for i, message in enumerate(record.messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise self._bad(record, f"message {i} has role {role!r}, expected one of {ROLES}")
            content = message.get("content")
            if not isinstance(content, list):
                raise self._bad(record, f"message {i} content must be a list of parts")
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    if any(token in part["text"] for token in self._special_tokens):
                        raise self._bad(record, f"message {i} text contains a special token literally",
                                        "special_token_text")
                    continue
                if kind in ("image", "video") and isinstance(part.get("path"), str) and part["path"]:
                    if kind == "video" and not self.video_token:
                        raise self._bad(record, f"message {i} has a video, which {type(self).__name__} does not take",
                                        "unsupported_video")
                    continue
                raise self._bad(record, f"message {i} has an unsupported part {part!r}")

    def _load_image(self, record: MLLMRecord, path: str) -> Image.Image:
        try:
            return load_image(path)
        except MLLMRecordError as err:
            raise self._bad(record, str(err), err.reason) from None

    def _encode_media(self, record: MLLMRecord, kind: str, hook: Callable, items: list) -> tuple[dict, list[int]]:
        """``hook(items)``: the media fields and token counts of one kind; a failure is a bad record."""
        if not items:
            return {}, []
        try:
            return hook(items)
        except MLLMRecordError as err:  # a video that does not decode, or not as its metadata said
            raise self._bad(record, str(err), err.reason) from None
        except Exception as err:  # noqa: BLE001 - any processor failure is a bad record
            raise MLLMRecordError(f"{record.origin}: {kind} preprocessing failed: {err}", REJECTED[kind],
                                  record_id=record.record_id) from err

    def _video_info(self, record: MLLMRecord, part: dict) -> VideoInfo:
        try:
            return read_video_info(part["path"], part.get("fps"))
        except MLLMRecordError as err:
            raise self._bad(record, str(err), err.reason) from None

    def _metadata_token_count(self, record: MLLMRecord, info: VideoInfo) -> int:
        """A video's token count from its metadata alone (container header or frame folder listing)."""
        try:
            return int(self.video_token_count(info))
        except Exception as err:  # noqa: BLE001 - the processor refuses this video (e.g. an extreme aspect ratio)
            raise self._bad(record, f"video {info.path!r} ({info.width}x{info.height}, {info.num_frames} frames at "
                            f"{info.fps:g} fps) refused by the video processor: {err}", REJECTED["video"]) from err

    def _header_token_count(self, record: MLLMRecord, path: str) -> int:
        """Token count from the file header alone (``Image.open`` reads the size without decoding)."""
        try:
            width, height = read_image_size(path)
        except MLLMRecordError as err:
            raise self._bad(record, str(err), err.reason) from None
        try:
            return int(self.image_token_count(width, height))
        except Exception as err:  # noqa: BLE001 - the processor refuses this size (e.g. an extreme aspect ratio)
            raise self._bad(record, f"image {path!r} ({width}x{height}) refused by the image processor: {err}",
                            REJECTED["image"]) from err

    def _render(self, messages: list[dict], counts: dict[str, list[int]], videos: list[VideoInfo]) -> str:
        """The chat-template text of ``messages`` with the i-th image placeholder repeated ``counts["image"][i]``
        times and the i-th video part replaced by ``video_text(videos[i], counts["video"][i])``."""
        if not messages:
            return ""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        seen = dict.fromkeys(self._parts.values(), 0)

        def expand(match: re.Match) -> str:
            kind = self._parts[match.group(0)]
            index, seen[kind] = seen[kind], seen[kind] + 1
            if index >= len(counts[kind]):
                raise ValueError(f"template rendered more than the {len(counts[kind])} {kind}(s) counted")
            if kind == "video":
                return self.video_text(videos[index], counts[kind][index])
            return self.image_text(counts[kind][index])

        return self._placeholder_split.sub(expand, text)

    def _assistant_spans(self, messages: list[dict], counts: dict[str, list[int]],
                         videos: list[VideoInfo]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character span (content + turn end) of every assistant turn."""
        renders = {len(messages): self._render(messages, counts, videos)}  # by prefix length: each rendered once

        def render(length: int) -> str:
            if length not in renders:
                renders[length] = self._render(messages[:length], counts, videos)
            return renders[length]

        full = renders[len(messages)]
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = render(k), render(k + 1)
            header = through.find(self.assistant_header, len(before))
            if not full.startswith(through) or not through.startswith(before) or header < 0:
                raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
            start = header + len(self.assistant_header)
            end = through.rindex(self.turn_end) + len(self.turn_end)
            if end <= start:
                raise ValueError(f"assistant turn {k} does not end with {self.turn_end!r}")
            spans.append((start, end))
        return full, spans

    def _layout(self, record: MLLMRecord, counts: dict[str, list[int]],
                videos: list[VideoInfo]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and labels (int64 arrays): a token is supervised when its characters lie inside an assistant
        span."""
        full, spans = self._text(record, counts, videos)
        [(ids, offsets)] = self._tokenize([full])
        return self._labelled(record, counts, ids, offsets, spans)

    def _text(self, record: MLLMRecord, counts: dict[str, list[int]],
              videos: list[VideoInfo]) -> tuple[str, list[tuple[int, int]]]:
        """:meth:`_assistant_spans` of the record, a template that fails being a bad record."""
        try:
            return self._assistant_spans(record.messages, counts, videos)
        except (ValueError, TemplateError) as err:  # TemplateError: the template's own raise_exception (Gemma 3:
            # roles must alternate)
            raise self._bad(record, str(err), "template_error") from err

    def _tokenize(self, texts: list[str]) -> list[tuple[list[int], list]]:
        """``(token ids, character offsets)`` of each text, in one tokenizer call."""
        if not texts:
            return []
        # verbose=False: a record longer than the tokenizer's model_max_length is measured, then the packing spec
        # admits, truncates or names it; transformers' "will result in indexing errors" warning would mislead
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return list(zip(encoded["input_ids"], encoded["offset_mapping"]))

    def _labelled(self, record: MLLMRecord, counts: dict[str, list[int]], ids: list[int], offsets: list,
                  spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and labels of a tokenized text (numpy: a handful of tiny torch ops cost more than the rest of a
        record's measure); its placeholder counts checked against the media's."""
        input_ids = np.asarray(ids, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        supervised = np.zeros(len(input_ids), dtype=bool)
        for start, end in spans:
            supervised |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])
        supervised &= ~_any_of(input_ids, self._unsupervised_ids)
        labels = np.where(supervised, input_ids, IGNORE_INDEX)
        found = np.bincount(self.placeholder_types(torch.from_numpy(input_ids)).numpy(),
                            minlength=len(self._placeholders) + 1)
        for code, (kind, token, _) in enumerate(self._placeholders, start=1):
            found_kind, needed = int(found[code]), sum(counts[kind])
            if found_kind != needed:
                raise self._bad(record, f"{found_kind} {kind} tokens in the text but the {kind}s need {needed} "
                                f"(a literal {token} in a text part?)", TOKEN_MISMATCH[kind])
        return input_ids, labels

    @staticmethod
    def _bad(record: MLLMRecord, what: str, reason: str = "invalid_record") -> MLLMRecordError:
        """A bad-record error naming the record (origin and id) with its fault class."""
        return MLLMRecordError(f"{record.origin}: record {record.record_id!r}: {what}", reason,
                               record_id=record.record_id)

    def video_token_groups(self, info: VideoInfo) -> int:
        """Equal groups of a video's tokens that the vision tower attends separately (the cost model's
        ``SampleMeta.media_sq``): one per temporal patch for a video processor with ``grid_thw`` (the Qwen families'
        attend frame group by frame group), else 1 (the whole clip at once). Override where that is wrong."""
        grid_thw = getattr(getattr(self, "video_processor", None), "grid_thw", None)
        return int(grid_thw(info)[0]) if grid_thw is not None else 1

    def _media_sq(self, counts: dict[str, list[int]], videos: list[VideoInfo]) -> int:
        """``SampleMeta.media_sq``: each image's tokens squared, each video's per attention group."""
        groups = [max(1, self.video_token_groups(info)) for info in videos]
        return sum(n * n for n in counts["image"]) + sum(n * n // g for n, g in zip(counts["video"], groups))

    def _token_types(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{token_type_field: 0 text / 1 image / 2 video}`` per token, or nothing without a ``token_type_field``."""
        if not self.token_type_field:
            return {}
        return {self.token_type_field: self.placeholder_types(input_ids)}

    def placeholder_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image placeholder, 2 video placeholder per token, by placeholder id. A model whose videos reuse
        the image placeholder (frames of image tokens between video markers) overrides it: the kind of a token then
        depends on where it sits, and the token counts are checked by kind."""
        types = torch.zeros_like(input_ids)
        for code, (_, _, token_id) in enumerate(self._placeholders, start=1):
            types[input_ids == token_id] = code
        return types

    def _media_end(self, input_ids: np.ndarray) -> int:
        positions = np.flatnonzero(_any_of(input_ids, self._placeholder_ids))
        return int(positions[-1]) + 1 if positions.size else 0


def _any_of(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Which ids are among a handful of ``values``: ``np.isin`` without its sort, ~10x cheaper on a record's ids."""
    return (ids[:, None] == values).any(axis=1)


class FixedImageTokens:
    """Encoder mixin (before the encoder class in the bases) for models whose every image becomes the same number
    of placeholder tokens (LLaVA's ``image_seq_length``, Gemma 3's ``mm_tokens_per_image``): the processor bundle's
    ``image_processor`` gives the pixels and its ``image_seq_length`` the count, so ``measure`` needs only an
    image header that opens."""

    def __init__(self, processor):
        super().__init__(processor)
        self.image_processor = processor.image_processor
        self.tokens_per_image = int(processor.image_seq_length)
        if self.tokens_per_image < 1:
            raise ValueError(f"{type(processor).__name__}.image_seq_length must be set (build it with "
                             "build_processor)")

    def encode_images(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixel_values}, [self.tokens_per_image] * len(images)

    def image_token_count(self, width: int, height: int) -> int:
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        return self.tokens_per_image
