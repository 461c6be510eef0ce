"""Qwen2-VL sample encoder: records -> ``MLLMSample`` (encode) and ``SampleMeta`` (measure, headers only).

Layout, per the Qwen2-VL chat template: every image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``
and its ``<|image_pad|>`` is expanded to the image's merged token count ``t*h*w / merge**2`` (the count the model's
vision tower emits, checked by the model at forward time). Only assistant turns are supervised: the assistant's
content and its closing ``<|im_end|>``; the template's role header and trailing newline are not. Vision special
tokens are never supervised, even inside an assistant turn.

``encode`` and ``measure`` share one layout function and differ only in where the per-image token counts come
from: the image processor's ``image_grid_thw`` (encode) or ``smart_resize`` on the header size (measure). Both go
through the kit's image helpers (EXIF rotation applied on both sides), so the counts agree; a test checks it.
"""

from __future__ import annotations

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mvp_engine.kit.mllm.data.images import load_image, read_image_size
from mvp_engine.kit.mllm.data.sample import IGNORE_INDEX, MLLMRecord, MLLMSample, SampleMeta
from mvp_engine.kit.mllm.data.sources import MLLMRecordError

from .model import IMAGE_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN, Qwen2VLProcessorBundle

ROLES = ("system", "user", "assistant")
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


class Qwen2VLSampleEncoder:
    """Implements ``MLLMSampleEncoder`` for Qwen2-VL; every error names ``record.origin``."""

    def __init__(self, processor: Qwen2VLProcessorBundle):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.image_token_id = processor.token_id(IMAGE_TOKEN)
        self._unsupervised_ids = torch.tensor(
            [self.image_token_id, processor.token_id(VISION_START_TOKEN), processor.token_id(VISION_END_TOKEN)]
        )
        self._special_tokens = sorted(set(self.tokenizer.all_special_tokens))
        size = self.image_processor.size
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.patch_size = int(self.image_processor.patch_size)
        self.merge_size = int(self.image_processor.merge_size)

    # ------------------------------------------------------------------------------------------------- public

    def encode(self, record: MLLMRecord) -> MLLMSample:
        self._validate(record)
        images = [self._load_image(record, path) for path in record.image_paths]
        media: dict[str, torch.Tensor] = {}
        counts: list[int] = []
        if images:
            try:
                out = self.image_processor(images=images, return_tensors="pt")
            except Exception as err:  # noqa: BLE001 - any processor failure is a bad record
                raise ValueError(f"{record.origin}: image preprocessing failed: {err}") from err
            grid = out["image_grid_thw"].long()
            media = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
            counts = [int(n) for n in grid.prod(-1) // self.merge_size**2]
        input_ids, labels = self._layout(record, counts)
        return MLLMSample(
            input_ids=input_ids,
            labels=labels,
            sample_id=record.record_id,
            media=media,
            num_media=len(counts),
            media_tokens=sum(counts),
            media_end=self._media_end(input_ids),
        )

    def measure(self, record: MLLMRecord) -> SampleMeta:
        self._validate(record)
        counts = [self._header_token_count(record, path) for path in record.image_paths]
        input_ids, _ = self._layout(record, counts)
        return SampleMeta(length=int(input_ids.numel()), num_media=len(counts), media_end=self._media_end(input_ids))

    # ------------------------------------------------------------------------------------------------ helpers

    def _validate(self, record: MLLMRecord) -> None:
        if not isinstance(record.messages, list) or not record.messages:
            raise ValueError(f"{record.origin}: record {record.record_id!r} has no messages")
        for i, message in enumerate(record.messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise ValueError(f"{record.origin}: message {i} has role {role!r}, expected one of {ROLES}")
            content = message.get("content")
            if not isinstance(content, list):
                raise ValueError(f"{record.origin}: message {i} content must be a list of parts")
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    if any(token in part["text"] for token in self._special_tokens):
                        raise ValueError(f"{record.origin}: message {i} text contains a special token literally")
                    continue
                if kind == "image" and isinstance(part.get("path"), str) and part["path"]:
                    continue
                raise ValueError(f"{record.origin}: message {i} has an unsupported part {part!r}")

    def _load_image(self, record: MLLMRecord, path: str) -> Image.Image:
        try:
            return load_image(path)
        except MLLMRecordError as err:
            raise ValueError(f"{record.origin}: {err}") from None

    def _header_token_count(self, record: MLLMRecord, path: str) -> int:
        """Merged token count from the file header alone (``Image.open`` reads the size without decoding)."""
        try:
            width, height = read_image_size(path)
        except MLLMRecordError as err:
            raise ValueError(f"{record.origin}: {err}") from None
        try:
            factor = self.patch_size * self.merge_size
            h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"{record.origin}: cannot read image {path!r}: {err}") from err
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def _render(self, messages: list[dict], counts: list[int]) -> str:
        """The chat-template text of ``messages`` with the i-th ``<|image_pad|>`` repeated ``counts[i]`` times."""
        if not messages:
            return ""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 > len(counts):
            raise ValueError(f"template rendered {len(pieces) - 1} images, {len(counts)} counted")
        out = [pieces[0]]
        for count, piece in zip(counts, pieces[1:]):
            out.append(IMAGE_TOKEN * count + piece)
        return "".join(out)

    def _layout(self, record: MLLMRecord, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and labels; supervised character spans come from rendering growing prefixes of the chat."""
        messages = record.messages
        try:
            full = self._render(messages, counts)
            spans = []
            for k, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self._render(messages[:k], counts)
                through = self._render(messages[: k + 1], counts)
                start = len(before) + len(ASSISTANT_HEADER)
                end = through.rindex(TURN_END) + len(TURN_END)
                if not full.startswith(through) or through[len(before):start] != ASSISTANT_HEADER:
                    raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
                spans.append((start, end))
        except ValueError as err:
            raise ValueError(f"{record.origin}: {err}") from err
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.long).view(-1, 2)
        supervised = torch.zeros(input_ids.numel(), dtype=torch.bool)
        for start, end in spans:
            supervised |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])
        supervised &= ~torch.isin(input_ids, self._unsupervised_ids)
        labels = torch.where(supervised, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        n_pads = int((input_ids == self.image_token_id).sum())
        if n_pads != sum(counts):
            raise ValueError(
                f"{record.origin}: {n_pads} image tokens in the text but the images need {sum(counts)} "
                "(a literal <|image_pad|> in a text part?)"
            )
        return input_ids, labels

    def _media_end(self, input_ids: torch.Tensor) -> int:
        positions = (input_ids == self.image_token_id).nonzero()
        return int(positions[-1]) + 1 if positions.numel() else 0
