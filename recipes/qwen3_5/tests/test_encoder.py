"""The Qwen3.5 artifacts: a reproducible tokenizer asset (``tools/build_tokenizer_assets.py --only qwen3_5``) and a
save/load round trip that reloads the boundary-aware model (same encoding, same logits). The encoder itself is the
shared ``Qwen3SampleEncoder``, whose measure == encode, labels and errors the qwen3_vl recipe's ``EncoderSuite``
checks."""

import mvp_engine.engine.testing as kit
from mvp_engine.packing import linear_attention_enabled
from recipes.qwen3_5.model import build_model


def test_tokenizer_asset_is_reproducible(tmp_path):
    kit.check_tokenizer_asset("qwen3_5", tmp_path)


def test_save_load_round_trip_keeps_the_linear_layers_boundary_aware(tmp_path):
    kit.check_save_load_round_trip("qwen3_5", tmp_path)
    assert linear_attention_enabled(build_model({"pretrained": str(tmp_path / "ckpt")}, "sdpa"))
