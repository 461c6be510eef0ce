"""A few real training steps per packing mode on the demo data (the kit's ``SmokeSuite``), plus a checkpoint
round trip after training."""

import torch

from mvp_engine.engine.testing import smoke_run
from mvp_engine.engine.testkit.suites import SmokeSuite
from recipes.qwen2_vl.model import build_model, build_processor


class TestSmoke(SmokeSuite):
    recipe = "qwen2_vl"


def test_checkpoint_round_trip(tmp_path):
    summary = smoke_run("qwen2_vl", "greedy", tmp_path / "run", overrides=("train.epochs=1",))
    model_dir = tmp_path / "run" / "model"
    reloaded = build_model({"pretrained": str(model_dir)}, "sdpa").eval()
    processor = build_processor({"pretrained": str(model_dir)})
    ids = processor.tokenizer("a red circle", return_tensors="pt").input_ids
    trained = build_model({"pretrained": str(model_dir)}, "eager").eval()
    with torch.no_grad():
        a = reloaded(input_ids=ids, use_cache=False).logits
        b = trained(input_ids=ids, use_cache=False).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert summary["actual_steps"] >= 1
