"""Packed LLaVA forwards/backwards equal one-by-one ones on eager, sdpa and flex_attention (the kit's
``EquivalenceSuite``; flash's kwargs through a CPU varlen reference), plus LLaVA's own guard."""

import pytest

from mvp_engine.engine.testkit.suites import EquivalenceSuite
from recipes.llava.packed import prepare_packed


class TestPackedEquivalence(EquivalenceSuite):
    recipe = "llava"

    def test_vision_tower_on_flash_is_refused(self, case):
        """LLaVA hands the vision tower every extra kwarg: on flash it would read the text's cu_seq_lens."""
        model = case.recipe.build_model(case.model_cfg, "sdpa")
        for config in (model.config.text_config, model.config.vision_config):
            config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="vision tower"):
            prepare_packed(case.batch, model, "flash_attention_2")
