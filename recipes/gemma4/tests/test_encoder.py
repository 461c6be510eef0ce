"""The Gemma 4 encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, save/load round trip, a reproducible tokenizer asset, no torchvision), plus the comparison with
transformers' own Gemma 4 processing on the same conversations: the same ids, ``mm_token_type_ids``, pixels and
patch positions, and ``measure``'s soft-token count from the header on images of many sizes and aspect ratios."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import Gemma4Processor
from transformers.processing_utils import ProcessorMixin

from mvp_engine.engine.testing import demo_like_records
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import MLLMRecord
from mvp_engine.kit.mllm.data.images import load_image


class TestEncoder(EncoderSuite):
    recipe = "gemma4"

    def test_every_image_is_its_soft_tokens_between_start_and_end_of_image(self, encoder, tmp_path):
        for record in demo_like_records(tmp_path):
            sample = encoder.encode(record)
            types = sample.token_fields["mm_token_type_ids"]
            assert torch.equal(types == 1, sample.input_ids == encoder.image_token_id)
            assert int(types.sum()) == sample.media_tokens
            text = encoder.tokenizer.decode(sample.input_ids)
            assert text.count("\n\n<|image>") == text.count("<image|>\n\n") == sample.num_media
            if sample.num_media:
                pixels, positions = sample.media["pixel_values"], sample.media["image_position_ids"]
                assert tuple(pixels.shape) == (sample.num_media, 280, 48)  # 70 soft tokens x 2 x 2 patches of 4 x 4
                assert tuple(positions.shape) == (sample.num_media, 280, 2)
                assert int((positions != -1).all(-1).sum()) == 4 * sample.media_tokens

    def test_encoding_equals_transformers_gemma4_processing(self, encoder, tmp_path):
        """transformers' ``Gemma4Processor.replace_image_token`` (each placeholder of the chat template's text
        becomes ``<|image>`` + the image's soft tokens + ``<image|>``) and ``create_mm_token_type_ids``, over the
        same tokenizer and ``Gemma4ImageProcessorPil``, on single, multi-image and text-only records: the same ids,
        token types, pixels and positions. (A whole ``Gemma4Processor`` cannot be built here: its video processor
        needs torchvision, which this project does without.)"""
        tokenizer = encoder.tokenizer
        processor = SimpleNamespace(boi_token=tokenizer.boi_token, eoi_token=tokenizer.eoi_token,
                                    image_token=tokenizer.image_token, image_token_ids=[tokenizer.image_token_id],
                                    video_token_ids=[], audio_token_ids=[])
        records = demo_like_records(tmp_path)
        assert {len(r.image_paths) for r in records} == {0, 1, 3}
        for record in records:
            ours = encoder.encode(record)
            images = [load_image(path) for path in record.image_paths]
            inputs = encoder.image_processor(images=images, return_tensors="pt") if images else {}
            first, *rest = tokenizer.apply_chat_template(record.messages, tokenize=False).split(tokenizer.image_token)
            text = first + "".join(Gemma4Processor.replace_image_token(processor, inputs, i) + piece
                                   for i, piece in enumerate(rest))
            ids = tokenizer(text)["input_ids"]
            assert ids == ours.input_ids.tolist(), record.origin
            types = ProcessorMixin.create_mm_token_type_ids(processor, [ids])[0]
            assert types == ours.token_fields["mm_token_type_ids"].tolist(), record.origin
            if images:
                assert torch.equal(inputs["pixel_values"], ours.media["pixel_values"]), record.origin
                assert torch.equal(inputs["image_position_ids"], ours.media["image_position_ids"]), record.origin

    @pytest.mark.parametrize("size", [(8, 8), (64, 64), (640, 480), (33, 97), (300, 20), (20, 300), (4, 1000)])
    def test_measure_counts_the_processors_soft_tokens_from_the_header(self, encoder, tmp_path, size):
        path = tmp_path / "image.png"
        Image.new("RGB", size, (200, 30, 30)).save(path)
        messages = [{"role": "user", "content": [{"type": "image", "path": str(path)},
                                                  {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "A red image."}]}]
        record = MLLMRecord("r", "sizes.jsonl:1", messages)
        sample = encoder.encode(record)
        assert encoder.measure(record) == sample.meta
        expected = int(encoder.image_processor(images=[Image.open(path)])["num_soft_tokens_per_image"][0])
        assert sample.media_tokens == expected
