"""The GLM-4.5V encoder and artifacts: GLM-4.1V's encoder, tokenizer and processors (``recipes.glm4v``) through the
kit's ``EncoderSuite`` (measure == encode on many images and clips, assistant-only labels, errors naming the record,
the encoding equal to transformers' ``Glm4vProcessor``'s on images, clips and text, a save/load round trip that
reloads the MoE model with its experts implementation), and the tokenizer: GLM-4.1V's committed asset (GLM-4.5V ships
the same special tokens; ``recipes/glm4v/tests/test_encoder.py`` checks the asset's reproducibility). GLM-4.5V
checkpoints take transformers' ``Glm4vProcessor`` as GLM-4.1V's do."""

from transformers import AutoTokenizer
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from recipes.glm4v.model import DEFAULT_TOKENIZER_DIR
from recipes.glm4v_moe.model import build_model


class TestEncoder(EncoderSuite):
    recipe = "glm4v_moe"

    @classmethod
    def hf_processor(cls, encoder):
        return kit.transformers_processor(Glm4vProcessor, encoder)

    def test_save_load_round_trip(self, tmp_path):
        """The suite's round trip; the reloaded model's experts compute with the configured implementation."""
        kit.check_save_load_round_trip(self.recipe, tmp_path)
        cfg = kit.compose_config(self.recipe, [f"model.pretrained={tmp_path / 'ckpt'}"]).model
        model = build_model(cfg, "sdpa")
        assert model.config.get_text_config()._experts_implementation == cfg.experts_implementation == "grouped_mm"

    def test_tokenizer_asset_is_reproducible(self, encoder):
        """No asset of its own: the tokenizer is GLM-4.1V's committed one, token for token."""
        committed = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
        assert encoder.tokenizer.get_vocab() == committed.get_vocab()
        assert encoder.tokenizer.chat_template == committed.chat_template
