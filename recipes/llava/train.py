"""Train LLaVA: ``python -m recipes.llava.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe

from . import model, packed
from .encoder import LlavaSampleEncoder

RECIPE = Recipe.from_modules("llava", model=model, packed=packed, encoder=LlavaSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
