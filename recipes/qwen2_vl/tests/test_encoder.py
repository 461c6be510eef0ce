"""The Qwen2-VL encoder and artifacts (the kit's ``EncoderSuite``): measure == encode, assistant-only labels,
errors naming the record, save/load round trip, a reproducible tokenizer asset, no torchvision needed."""

import torch

from mvp_engine.engine.testkit.suites import EncoderSuite


class TestEncoder(EncoderSuite):
    recipe = "qwen2_vl"


def test_vision_tokens_are_never_supervised(encoder, samples):
    vision = torch.tensor([encoder.processor.token_id(t) for t in ("<|vision_start|>", "<|vision_end|>")])
    for sample in samples:
        assert not torch.isin(sample.labels, vision).any()
        assert (sample.input_ids == vision[0]).sum() == sample.num_media
