"""Train GLM-4.1V: ``python -m recipes.glm4v.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe

from . import model, packed
from .encoder import Glm4vSampleEncoder

RECIPE = Recipe.from_modules("glm4v", model=model, packed=packed, encoder=Glm4vSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
