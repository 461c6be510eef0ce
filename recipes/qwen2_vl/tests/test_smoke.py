"""A few real training steps per packing mode on the demo data (the kit's ``SmokeSuite``), plus a checkpoint
round trip after training."""

import torch

from mvp_engine.engine.testkit.smoke import smoke_trainer
from mvp_engine.engine.testkit.suites import SmokeSuite
from mvp_engine.packing import unwrap_model
from recipes.qwen2_vl.model import build_model, build_processor


class TestSmoke(SmokeSuite):
    recipe = "qwen2_vl"


def test_checkpoint_round_trip(tmp_path):
    """The saved model is the trained one held in memory (every weight, and its logits), not merely a folder that
    reloads to itself; training moved it away from the initial weights, so saving those would fail here."""
    trainer = smoke_trainer("qwen2_vl", "greedy", tmp_path / "run", overrides=("train.epochs=1",))
    summary = trainer.run()
    trained = unwrap_model(trainer.model).eval()
    model_dir = tmp_path / "run" / "model"
    reloaded = build_model({"pretrained": str(model_dir)}, "sdpa").eval()
    initial = build_model(trainer.cfg.model, "sdpa").eval()
    saved = reloaded.state_dict()
    assert sorted(saved) == sorted(trained.state_dict())
    assert all(torch.equal(saved[name], value) for name, value in trained.state_dict().items())
    ids = build_processor({"pretrained": str(model_dir)}).tokenizer("a red circle", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b, before = (m(input_ids=ids, use_cache=False).logits for m in (reloaded, trained, initial))
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(before, b, atol=1e-3)
    assert summary["actual_steps"] >= 1
