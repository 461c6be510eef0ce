"""The Gemma 3 encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, the encoding equal to transformers' ``Gemma3Processor``'s (ids, ``token_type_ids``, pixels),
save/load round trip, a reproducible tokenizer asset), plus the image layout and the template's refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Processor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import MLLMRecord, MLLMRecordError
from recipes.gemma3.model import tiny_config


class TestEncoder(EncoderSuite):
    recipe = "gemma3"

    @classmethod
    def hf_processor(cls, encoder):
        """``Gemma3Processor`` with the model config's ``mm_tokens_per_image`` soft tokens per image."""
        config = tiny_config(kit.compose_config(cls.recipe).model, encoder.tokenizer)
        return kit.transformers_processor(Gemma3Processor, encoder, image_seq_length=config.mm_tokens_per_image)

    def test_every_image_is_its_soft_tokens_between_start_and_end_of_image(self, encoder, tmp_path):
        for record in kit.demo_like_records(tmp_path):
            sample = encoder.encode(record)
            types = sample.token_fields["token_type_ids"]
            assert int(types.sum()) == sample.media_tokens == 16 * sample.num_media
            assert torch.equal(types.bool(), sample.input_ids == encoder.image_token_id)
            text = encoder.tokenizer.decode(sample.input_ids)
            assert text.count("<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>") == sample.num_media
            if sample.num_media:
                assert tuple(sample.media["pixel_values"].shape) == (sample.num_media, 3, 56, 56)

    def test_roles_that_do_not_alternate_are_a_bad_record_naming_it(self, encoder):
        """Gemma 3's template raises (jinja's TemplateError) on two user turns in a row: a bad record, not a crash."""
        record = MLLMRecord("r7", "chat.jsonl:7", [kit.user(kit.text("a")), kit.user(kit.text("b")),
                                                   kit.assistant("c")])
        for call in (encoder.measure, encoder.encode):
            with pytest.raises(MLLMRecordError, match="chat.jsonl:7.*alternate") as err:
                call(record)
            assert err.value.reason == "template_error"
