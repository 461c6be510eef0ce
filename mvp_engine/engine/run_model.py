"""A run's model before any parallel step (``parallel.parallelize`` comes next), prepared one way for training,
evaluation and planning: the recipe's model (a ``pretrained`` folder's or a seeded fresh init), its LoRA adapters
(``model.lora``), then its frozen parameters (``model.freeze`` and those no forward reaches).

Why one function: the cost profile a report or a step estimate plans with is the trainer's only when it is read
from the same model, adapters and frozen parameters included (a frozen base layer costs no weight gradient).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from omegaconf import DictConfig

from .builders import pretrained_without_weights
from .config import ModelSpec
from .lora import add_adapters
from .participation import ParameterReport, freeze_parameters
from .quantize import quantize_base
from .recipe import Recipe

PURPOSES = ("train", "eval", "plan")


def prepare_model(recipe: Recipe, model_cfg: DictConfig, spec: ModelSpec, attention: str, purpose: str = "train",
                  without_weights: bool = False) -> tuple[torch.nn.Module, ParameterReport | None]:
    """The model and its parameter report, for ``purpose``:

    - ``train``: built with ``attention`` (``without_weights``: a pretrained model from its config alone, parameters
      on the meta device, for the ranks that receive FSDP2 shards from rank 0), the layers the adapters wrap
      quantized (``model.quantization``), adapters added before freezing (which then sees them as ordinary
      layers), then frozen;
    - ``eval``: the model as it is saved (a merged LoRA folder loads as a plain model, an adapter folder as its base
      with the saved adapters), no adapters added, nothing frozen (no report);
    - ``plan``: on the meta device, no weights (a pretrained folder's config only), adapters and freezing as in
      training: what the cost model reads.

    ``model_cfg`` is the recipe's whole ``cfg.model`` (its hooks read family keys); ``spec`` is its validated
    engine part."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r} is invalid: allowed one of {list(PURPOSES)}")
    if purpose == "plan":
        with torch.device("meta"):
            model = _config_only(recipe, model_cfg, spec)
            add_adapters(model, spec.lora, spec.seed)
    else:
        with pretrained_without_weights() if without_weights else nullcontext():
            model = recipe.build_model(model_cfg, attention)
        if purpose == "eval":
            return model, None
        quantize_base(model, spec)  # the layers the adapters wrap, before they wrap them (model.quantization)
        model = add_adapters(model, spec.lora, spec.seed)
    return model, freeze_parameters(model, spec.freeze, recipe.unreachable_parameters(model))


def _config_only(recipe: Recipe, model_cfg: DictConfig, spec: ModelSpec) -> torch.nn.Module:
    """The model's structure without weights (called on the meta device): a pretrained folder through its config,
    a fresh init through the recipe (eager: the backend changes no parameter)."""
    if spec.pretrained:
        from transformers import AutoConfig, AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(spec.pretrained))
    return recipe.build_model(model_cfg, "eager")
