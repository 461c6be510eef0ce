"""What a recipe hands the engine: the model-specific pieces, nothing else."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from types import ModuleType
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMSampleEncoder
from mvp_engine.packing.batch_metadata import describe_packed


def no_unreachable_parameters(model) -> list[str]:
    """The default: every parameter takes part in some forward."""
    return []


def layout_metadata(model) -> Callable[[dict], dict]:
    """The default collator metadata of packed batches: their layout (``batch_metadata.describe_packed``), enough for
    every model that takes the per-segment text positions."""
    return describe_packed


def _packed_metadata(packed: ModuleType) -> Callable[[Any], Callable[[dict], dict]]:
    """The ``packed_metadata`` of a recipe's packed module, else of the module its ``prepare_packed`` comes from (a
    family's, bound with ``functools.partial``: its positions are the family's too), else the layout alone."""
    prepare = packed.prepare_packed
    family = inspect.getmodule(getattr(prepare, "func", prepare))
    return getattr(packed, "packed_metadata", None) or getattr(family, "packed_metadata", layout_metadata)


@dataclass(frozen=True)
class Recipe:
    """A model family's hooks.

    ``prepare_packed(batch, model, attn_implementation)`` turns a collated packed batch into model kwargs for
    the backend (masks, positions, cu_seqlens, ``use_cache=False``); ``prepare_padded`` does the same for the
    unpacked baseline. Both return kwargs without labels: the engine computes the loss from the logits.

    ``dummy_media(model)`` gives the kwargs of ``model.get_image_features`` for one tiny image, which the engine
    runs zero-weighted on micro-batches without media; ``unreachable_parameters(model)`` names parameters no
    forward can reach, which the engine freezes (both: ``mvp_engine.engine.participation``).

    ``cost_profile(model, unreachable)`` returns the model's ``CostProfile``: for a VLM the engine's generic
    reading (``mvp_engine.engine.flops.cost_profile``) given where its vision tower and projector sit and its vision
    geometry, both family facts; None (a text-only model) is the generic reading alone.

    ``parallelize(model, layout, train)`` (optional) is the family's own parallel plan (a tensor or expert split),
    applied by ``mvp_engine.engine.parallel.parallelize`` after recomputation and context-parallel attention and
    before FSDP2 / DDP; it returns the model. None: the generic plan alone.

    ``packed_metadata(model)`` gives the function the run's collator applies to each packed batch, on the CPU in the
    loader's workers: the packed metadata ``prepare_packed`` would otherwise compute in the step from device tensors
    (``mvp_engine.packing.batch_metadata``; the M-RoPE families add their positions). Default: the layout alone.

    ``moe_routers(model)`` (optional; mixture-of-experts models) returns the model's
    ``mvp_engine.engine.router_balance.Routers`` (None: no experts): its router modules, one per MoE layer in layer
    order, each called once per forward on the language model's flattened ``[B * L, hidden]`` tokens; E and top-k;
    the model config's aux-loss coefficient where its own aux loss is on, else 0; and ``read(output, top_k)`` giving
    (fp32 router probabilities ``[B * L, E]`` in the autograd graph, chosen experts ``[B * L, top_k]``) from a
    router's forward output. ``router_balance.recorded_routers`` reads all of it from what a transformers MoE model
    declares (its ``router_logits`` recorder); a family whose routing differs passes its own ``read``. The engine
    hooks those modules, counts real tokens only and forms the load-balancing loss over the optimizer step; the
    recipe's ``prepare_packed`` / ``prepare_padded`` keep the model's own aux loss off (``output_router_logits``).

    ``model_types`` are the ``config.json`` ``model_type`` values a ``model.pretrained`` folder of this recipe may
    have (``model_folder.check_model_folder`` refuses another family's folder before it loads); empty: any.
    """

    name: str
    build_processor: Callable[[DictConfig], Any]
    build_model: Callable[[DictConfig, str], Any]
    build_encoder: Callable[[Any], MLLMSampleEncoder]
    pad_token_id: Callable[[Any], int]
    prepare_packed: Callable[[dict, Any, str], dict]
    prepare_padded: Callable[[dict, Any, str], dict]
    dummy_media: Callable[[Any], dict]
    unreachable_parameters: Callable[[Any], list[str]] = no_unreachable_parameters
    attention_backends: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")
    cost_profile: Callable[[Any, list[str]], Any] | None = None
    parallelize: Callable[[Any, Any, Any], Any] | None = None
    model_types: tuple[str, ...] = ()
    moe_routers: Callable[[Any], Any] | None = None
    packed_metadata: Callable[[Any], Callable[[dict], dict]] = layout_metadata

    @classmethod
    def from_modules(cls, name: str, *, model: ModuleType, packed: ModuleType,
                     encoder: Callable[[Any], MLLMSampleEncoder]) -> Recipe:
        """The recipe of a ``recipes/<name>`` laid out the usual way: ``model.build_processor`` /
        ``model.build_model``, ``packed.prepare_packed`` / ``packed.prepare_padded`` /
        ``packed.ATTENTION_BACKENDS`` / ``packed.packed_metadata`` (optional, also found beside a family's
        ``prepare_packed`` the recipe binds), ``model.dummy_media`` / ``model.unreachable_parameters`` (optional), the
        processor's ``pad_token_id``, ``model.cost_profile`` / ``model.parallelize`` / ``model.MODEL_TYPES`` /
        ``model.moe_routers`` (optional), and the encoder class."""
        return cls(
            name=name,
            build_processor=model.build_processor,
            build_model=model.build_model,
            build_encoder=encoder,
            pad_token_id=attrgetter("pad_token_id"),
            prepare_packed=packed.prepare_packed,
            prepare_padded=packed.prepare_padded,
            dummy_media=model.dummy_media,
            unreachable_parameters=getattr(model, "unreachable_parameters", no_unreachable_parameters),
            attention_backends=tuple(packed.ATTENTION_BACKENDS),
            cost_profile=getattr(model, "cost_profile", None),
            parallelize=getattr(model, "parallelize", None),
            model_types=tuple(getattr(model, "MODEL_TYPES", ())),
            moe_routers=getattr(model, "moe_routers", None),
            packed_metadata=_packed_metadata(packed),
        )


def load_recipe(name: str) -> Recipe:
    """The ``RECIPE`` of ``recipes/<name>/train.py``, imported by name at call time: recipes sit above the engine,
    so the engine names none of them in its imports (``get_recipe`` is the same function)."""
    return importlib.import_module(f"recipes.{name}.train").RECIPE


get_recipe = load_recipe


def recipe_name(cfg: DictConfig, chosen: str | None = None) -> str:
    """The recipe a composed config is for: ``chosen`` (a tool's own setting, e.g. ``report.recipe``), else the
    primary config's name (``--config-name``: ``conf/<recipe>.yaml``), else ``model.name``."""
    if chosen:
        return chosen
    if HydraConfig.initialized() and HydraConfig.get().job.config_name:
        return str(HydraConfig.get().job.config_name)
    return str(cfg.model.name)
