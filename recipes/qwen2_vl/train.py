"""Train Qwen2-VL: ``python -m recipes.qwen2_vl.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe

from . import model, packed
from .encoder import Qwen2VLSampleEncoder

RECIPE = Recipe.from_modules("qwen2_vl", model=model, packed=packed, encoder=Qwen2VLSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
