"""Train GLM-4.5V: ``python -m recipes.glm4v_moe.train +packing=greedy`` (no ``+packing``: padded baseline).

The encoder is GLM-4.1V's (``recipes.glm4v``), the packed inputs GLM-4.1V's with the model's own aux loss off
(``packed.py``)."""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe
from recipes.glm4v import Glm4vSampleEncoder

from . import model, packed

RECIPE = Recipe.from_modules("glm4v_moe", model=model, packed=packed, encoder=Glm4vSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
