"""Train Gemma 3: ``python -m recipes.gemma3.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe

from . import model, packed
from .encoder import Gemma3SampleEncoder

RECIPE = Recipe.from_modules("gemma3", model=model, packed=packed, encoder=Gemma3SampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
