"""Evaluate Qwen3-VL-MoE: ``python -m recipes.qwen3_vl_moe.evaluate model.pretrained=<dir>
data.eval_sources=[...]`` (optional ``+packing=greedy``); writes eval.json with eval_loss in the run directory."""

from __future__ import annotations

from mvp_engine.engine.evaluate import hydra_evaluate

from .train import RECIPE

main = hydra_evaluate(RECIPE)

if __name__ == "__main__":
    main()
