"""The Qwen2-VL encoder and artifacts (the kit's ``EncoderSuite``): measure == encode on many images and clips,
assistant-only labels, errors naming the record, the encoding equal to transformers' ``Qwen2VLProcessor``'s on
images, clips and text, save/load round trip, a reproducible tokenizer asset; vision markers never supervised."""

import torch
from transformers import Qwen2VLProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite


class TestEncoder(EncoderSuite):
    recipe = "qwen2_vl"

    @classmethod
    def hf_processor(cls, encoder):
        return kit.transformers_processor(Qwen2VLProcessor, encoder)


def test_vision_tokens_are_never_supervised(encoder, samples):
    vision = torch.tensor([encoder.processor.token_id(t) for t in ("<|vision_start|>", "<|vision_end|>")])
    for sample in samples:
        assert not torch.isin(sample.labels, vision).any()
        assert (sample.input_ids == vision[0]).sum() == sample.num_media
