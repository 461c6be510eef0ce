"""Train Qwen3-VL-MoE: ``python -m recipes.qwen3_vl_moe.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe
from recipes.qwen import Qwen3SampleEncoder

from . import model, packed

RECIPE = Recipe.from_modules("qwen3_vl_moe", model=model, packed=packed, encoder=Qwen3SampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
