"""A few real training steps per packing mode on the demo data, plus a checkpoint round trip."""

import pytest
import torch

from mvp_engine.engine.testing import check_smoke_summary, smoke_run
from recipes.qwen2_vl.model import build_model, build_processor


@pytest.mark.parametrize("packing", [None, "greedy", "bfd"])
def test_smoke_training(packing, tmp_path):
    summary = smoke_run("qwen2_vl", packing, tmp_path / "run")
    check_smoke_summary(summary)
    assert summary["packing"] == packing


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
