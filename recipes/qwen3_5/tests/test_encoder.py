"""The Qwen3.5 encoder and artifacts (the family's ``Qwen3SampleEncoder`` over Qwen3.5's tokenizer and processors,
through the kit's ``EncoderSuite``: measure == encode on many images and clips, assistant-only labels, errors naming
the record, the encoding equal to transformers' ``Qwen3VLProcessor``'s on images and text, a reproducible tokenizer
asset) and a save/load round trip that reloads the boundary-aware model (same encoding, same logits)."""

import mvp_engine.engine.testing as kit
from mvp_engine.packing import linear_attention_enabled
from recipes.qwen.tests.encoder_suite import Qwen3EncoderSuite
from recipes.qwen3_5.model import build_model


class TestEncoder(Qwen3EncoderSuite):
    recipe = "qwen3_5"

    def test_save_load_round_trip(self, tmp_path):
        """The suite's round trip, and the reloaded model's linear-attention layers still take sample boundaries."""
        kit.check_save_load_round_trip(self.recipe, tmp_path)
        assert linear_attention_enabled(build_model({"pretrained": str(tmp_path / "ckpt")}, "sdpa"))
