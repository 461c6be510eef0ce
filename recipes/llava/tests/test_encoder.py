"""The LLaVA encoder and artifacts (the kit's ``EncoderSuite``): measure == encode, assistant-only labels, errors
naming the record, the encoding equal to transformers' ``LlavaProcessor``'s (which counts an image's tokens from its
pixels and the vision tower's patch size), save/load round trip, a reproducible tokenizer asset."""

from transformers import LlavaProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from recipes.llava.model import tiny_config


class TestEncoder(EncoderSuite):
    recipe = "llava"

    @classmethod
    def hf_processor(cls, encoder):
        """``LlavaProcessor`` as a LLaVA checkpoint's processor is saved: the vision tower's patch size, the model's
        feature selection strategy and CLIP's class token as the one additional token."""
        config = tiny_config(kit.compose_config(cls.recipe).model, encoder.tokenizer)
        return kit.transformers_processor(LlavaProcessor, encoder, patch_size=config.vision_config.patch_size,
                                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                                          num_additional_image_tokens=1)

    def test_every_image_is_the_model_token_count(self, encoder, tmp_path):
        for record in kit.demo_like_records(tmp_path):
            sample = encoder.encode(record)
            assert sample.media_tokens == 16 * sample.num_media  # (56 / 14)^2 patches, CLS dropped
            if sample.num_media:
                assert tuple(sample.media["pixel_values"].shape) == (sample.num_media, 3, 56, 56)
