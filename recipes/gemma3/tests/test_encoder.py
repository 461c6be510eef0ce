"""The Gemma 3 encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, save/load round trip, a reproducible tokenizer asset, no torchvision), plus the comparison with
transformers' own ``Gemma3Processor`` on the same conversations: the same ids, ``token_type_ids`` and pixels."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Processor

from mvp_engine.engine.testing import assistant, demo_like_records, text, user
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import MLLMRecord, MLLMRecordError
from mvp_engine.kit.mllm.data.images import load_image


class TestEncoder(EncoderSuite):
    recipe = "gemma3"

    def test_every_image_is_its_soft_tokens_between_start_and_end_of_image(self, encoder, tmp_path):
        for record in demo_like_records(tmp_path):
            sample = encoder.encode(record)
            types = sample.token_fields["token_type_ids"]
            assert int(types.sum()) == sample.media_tokens == 16 * sample.num_media
            assert torch.equal(types.bool(), sample.input_ids == encoder.image_token_id)
            text = encoder.tokenizer.decode(sample.input_ids)
            assert text.count("<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>") == sample.num_media
            if sample.num_media:
                assert tuple(sample.media["pixel_values"].shape) == (sample.num_media, 3, 56, 56)

    def test_encoding_equals_transformers_gemma3_processor(self, encoder, tmp_path):
        """``Gemma3Processor`` over the same tokenizer and image processor, on the chat template's text of each
        record (single, multi-image with a system turn, text-only): ids, token types and pixels are identical."""
        processor = Gemma3Processor(image_processor=encoder.image_processor, tokenizer=encoder.tokenizer,
                                    image_seq_length=encoder.tokens_per_image,
                                    chat_template=encoder.tokenizer.chat_template)
        records = demo_like_records(tmp_path)
        assert {len(r.image_paths) for r in records} == {0, 1, 3}
        for record in records:
            ours = encoder.encode(record)
            images = [load_image(path) for path in record.image_paths]
            text = processor.apply_chat_template(record.messages, tokenize=False)
            theirs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
            assert torch.equal(theirs["input_ids"][0], ours.input_ids), record.origin
            assert torch.equal(theirs["token_type_ids"][0], ours.token_fields["token_type_ids"]), record.origin
            if images:
                assert torch.equal(theirs["pixel_values"], ours.media["pixel_values"]), record.origin

    def test_roles_that_do_not_alternate_are_a_bad_record_naming_it(self, encoder):
        """Gemma 3's template raises (jinja's TemplateError) on two user turns in a row: a bad record, not a crash."""
        record = MLLMRecord("r7", "chat.jsonl:7", [user(text("a")), user(text("b")), assistant("c")])
        for call in (encoder.measure, encoder.encode):
            with pytest.raises(MLLMRecordError, match="chat.jsonl:7.*alternate") as err:
                call(record)
            assert err.value.reason == "template_error"
