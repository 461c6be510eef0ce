"""Train Qwen2-VL: ``python -m recipes.qwen2_vl.train +packing=greedy`` (no ``+packing``: padded baseline)."""

from __future__ import annotations

from operator import attrgetter

import hydra
from omegaconf import DictConfig

from mvp_engine.engine.recipe import Recipe
from mvp_engine.engine.trainer import run_recipe

from .encoder import Qwen2VLSampleEncoder
from .model import build_model, build_processor
from .packed import prepare_packed, prepare_padded

RECIPE = Recipe(
    name="qwen2_vl",
    build_processor=build_processor,
    build_model=build_model,
    build_encoder=Qwen2VLSampleEncoder,
    pad_token_id=attrgetter("pad_token_id"),
    prepare_packed=prepare_packed,
    prepare_padded=prepare_padded,
    attention_backends=("eager", "sdpa", "flash_attention_2"),
)


@hydra.main(config_path="../../conf", config_name="qwen2_vl", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_recipe(cfg, RECIPE)


if __name__ == "__main__":
    main()
