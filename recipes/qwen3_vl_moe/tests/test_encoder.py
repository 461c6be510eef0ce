"""The Qwen3-VL-MoE encoder and artifacts: Qwen3-VL's encoder, tokenizer and processors (the family's
``Qwen3SampleEncoder``, ``recipes.qwen.qwen3_vl``) through the kit's ``EncoderSuite`` (measure == encode,
assistant-only labels, errors naming the record, the encoding equal to transformers' ``Qwen3VLProcessor``'s on images
and text), a save/load round trip that reloads the MoE model with its experts implementation, and the tokenizer:
Qwen3-VL's committed asset (whose reproducibility ``recipes/qwen3_vl/tests/test_encoder.py`` checks)."""

from transformers import AutoTokenizer

import mvp_engine.engine.testing as kit
from recipes.qwen.qwen3_vl import QWEN3_VL_TOKENIZER_DIR
from recipes.qwen.tests.encoder_suite import Qwen3EncoderSuite
from recipes.qwen3_vl_moe.model import build_model


class TestEncoder(Qwen3EncoderSuite):
    recipe = "qwen3_vl_moe"

    def test_save_load_round_trip(self, tmp_path):
        """The suite's round trip; the reloaded model computes its experts with the configured implementation."""
        kit.check_save_load_round_trip(self.recipe, tmp_path)
        cfg = kit.compose_config(self.recipe, [f"model.pretrained={tmp_path / 'ckpt'}"]).model
        model = build_model(cfg, "sdpa")
        assert model.config.get_text_config()._experts_implementation == cfg.experts_implementation == "grouped_mm"

    def test_tokenizer_asset_is_reproducible(self, encoder):
        """No asset of its own: the tokenizer is Qwen3-VL's committed one, token for token."""
        committed = AutoTokenizer.from_pretrained(QWEN3_VL_TOKENIZER_DIR)
        assert encoder.tokenizer.get_vocab() == committed.get_vocab()
        assert encoder.tokenizer.chat_template == committed.chat_template
