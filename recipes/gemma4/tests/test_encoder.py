"""The Gemma 4 encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, the encoding equal to transformers' ``Gemma4Processor``'s (ids, ``mm_token_type_ids``, pixels
and patch positions), save/load round trip, a reproducible tokenizer asset), plus the image layout and ``measure``'s
soft-token count from the header on images of many sizes and aspect ratios."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import Gemma4Processor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import MLLMRecord


class TestEncoder(EncoderSuite):
    recipe = "gemma4"

    @classmethod
    def hf_processor(cls, encoder):
        """``Gemma4Processor`` without audio or video processors (the recipe takes neither). transformers 5.24's
        ``validate_inputs`` refuses every call whose tokenizer has no audio begin / end tokens, audio or not
        (``audio is not None and audio_token is None or boa_token is None or eoa_token is None``: a missing
        ``boa_token`` alone raises); the recipe's tokenizer has none, so the processor's copy names stand-ins that
        nothing reads without audio."""
        processor = kit.transformers_processor(Gemma4Processor, encoder, feature_extractor=None)
        processor.boa_token = processor.eoa_token = "<unused: no audio>"
        return processor

    def test_every_image_is_its_soft_tokens_between_start_and_end_of_image(self, encoder, tmp_path):
        for record in kit.demo_like_records(tmp_path):
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
