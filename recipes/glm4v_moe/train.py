"""Train GLM-4.5V: ``python -m recipes.glm4v_moe.train +packing=greedy`` (no ``+packing``: padded baseline).

The encoder and packed inputs are GLM-4.1V's own modules (``recipes.glm4v``): the same tokens, mm_token_type_ids,
per-segment 3-D rope and backends. (transformers 5.24 declares flex_attention for GLM-4.5V; the shared packed
inputs offer what both GLM models declare.)"""

from __future__ import annotations

from mvp_engine.engine.entry import hydra_main
from mvp_engine.engine.recipe import Recipe
from recipes.glm4v import Glm4vSampleEncoder, packed

from . import model

RECIPE = Recipe.from_modules("glm4v_moe", model=model, packed=packed, encoder=Glm4vSampleEncoder)
main = hydra_main(RECIPE)

if __name__ == "__main__":
    main()
