"""Train Qwen3.5-MoE: ``python -m recipes.qwen3_5_moe.train +packing=greedy`` (no ``+packing``: padded baseline).

Packed inputs are Qwen3.5's with the model's own aux loss off (``packed.py``)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe
from recipes.qwen import Qwen3SampleEncoder

from . import model, packed

RECIPE = Recipe.from_modules("qwen3_5_moe", model=model, packed=packed, encoder=Qwen3SampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
