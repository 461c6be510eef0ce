"""The Qwen3.5-MoE encoder and artifacts: Qwen3.5's encoder, tokenizer and processors (the family's
``Qwen3SampleEncoder``) through the kit's ``EncoderSuite`` (measure == encode, assistant-only labels, errors naming
the record, the encoding equal to transformers' ``Qwen3VLProcessor``'s on images and text), a save/load round trip
that reloads the boundary-aware MoE model with its experts implementation, and the tokenizer: Qwen3.5's committed
asset (whose reproducibility ``recipes/qwen3_5/tests/test_encoder.py`` checks)."""

from transformers import AutoTokenizer

import mvp_engine.engine.testing as kit
from mvp_engine.packing import linear_attention_enabled
from recipes.qwen.tests.encoder_suite import Qwen3EncoderSuite
from recipes.qwen3_5.model import DEFAULT_TOKENIZER_DIR
from recipes.qwen3_5_moe.model import build_model


class TestEncoder(Qwen3EncoderSuite):
    recipe = "qwen3_5_moe"

    def test_save_load_round_trip(self, tmp_path):
        """The suite's round trip; the reloaded model's linear-attention layers still take sample boundaries and its
        experts compute with the configured implementation."""
        kit.check_save_load_round_trip(self.recipe, tmp_path)
        cfg = kit.compose_config(self.recipe, [f"model.pretrained={tmp_path / 'ckpt'}"]).model
        model = build_model(cfg, "sdpa")
        assert linear_attention_enabled(model)
        assert model.config.get_text_config()._experts_implementation == cfg.experts_implementation == "grouped_mm"

    def test_tokenizer_asset_is_reproducible(self, encoder):
        """No asset of its own: the tokenizer is Qwen3.5's committed one, token for token."""
        committed = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
        assert encoder.tokenizer.get_vocab() == committed.get_vocab()
        assert encoder.tokenizer.chat_template == committed.chat_template
