"""The LLaVA encoder and artifacts (the kit's ``EncoderSuite``): measure == encode, assistant-only labels, errors
naming the record, save/load round trip, a reproducible tokenizer asset, no torchvision needed."""

from mvp_engine.engine.testing import demo_like_records
from mvp_engine.engine.testkit.suites import EncoderSuite


class TestEncoder(EncoderSuite):
    recipe = "llava"

    def test_every_image_is_the_model_token_count(self, encoder, tmp_path):
        for record in demo_like_records(tmp_path):
            sample = encoder.encode(record)
            assert sample.media_tokens == 16 * sample.num_media  # (56 / 14)^2 patches, CLS dropped
            if sample.num_media:
                assert tuple(sample.media["pixel_values"].shape) == (sample.num_media, 3, 56, 56)
