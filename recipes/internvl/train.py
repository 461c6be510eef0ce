"""Train InternVL: ``python -m recipes.internvl.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe

from . import model, packed
from .encoder import InternVLSampleEncoder

RECIPE = Recipe.from_modules("internvl", model=model, packed=packed, encoder=InternVLSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
