"""``model.lora``: LoRA adapters through peft, trained on a frozen base, saved as a peft adapter folder.

The adapters are injected in place by ``peft.get_peft_model``: the recipe's own transformers model stays the module
the engine trains, prepares inputs for, wraps in DDP or shards with FSDP2 (its targeted ``nn.Linear`` layers become
peft ``lora.Linear`` layers holding the frozen ``base_layer``); peft's ``PeftModel`` is only the handle that saves.
Everything model-free sees the adapters as ordinary trainable parameters: checkpoints (:class:`Checkpointer` keeps
the trainable ones only), the parameter report, and the FLOPs (each frozen ``base_layer`` costs no weight gradient).

``target_modules`` are module-name patterns as ``model.freeze`` reads them (fnmatch, a module and everything under
it): every ``nn.Linear`` at or under a matching module gets an adapter. The default names the language model's
attention (``self_attn``, ``linear_attn``) and MLP of every layer; the vision tower (``model.vision_tower`` /
``model.visual``) and the projector can be named too.

The final ``model/`` folder is saved from the gathered state dict into a fresh copy of the model (built without
weights where it is ``pretrained``), so one path serves one process, DDP and FSDP2: peft's ``save_pretrained``
writes the adapter (``adapter_config.json``, ``adapter_model.safetensors``), and ``merge_on_save`` adds
``model/merged``, peft's ``merge_and_unload`` saved with ``save_pretrained`` (what ``model.pretrained=`` loads).

An adapter folder holds its base, so ``model.pretrained=<run>/model`` loads base plus adapters offline: a
``pretrained`` base is named by its absolute path (``base_model_name_or_path``); a fresh (seeded, random) base, which
no path names, is saved beside the adapters (``config.json``, ``model.safetensors``), the layout transformers'
``from_pretrained`` loads as a local model with its adapter. Without either, peft would name no base and transformers
would look for one on the model hub.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model
from peft.utils import ModulesToSaveWrapper

from .builders import pretrained_without_weights, to_plain
from .config import ConfigError, LoraSpec, _to_object
from .participation import _matches

MERGED = "merged"  # model/merged: the merged save_pretrained model
ADAPTER_CONFIG = "adapter_config.json"  # peft's: what makes a folder an adapter folder
BASE_CONFIG = "config.json"  # a saved model's: beside the adapters, the base they were trained on


def lora_spec(model_cfg) -> LoraSpec:
    """The validated ``model.lora`` of a composed model config (absent: off)."""
    node = (to_plain(model_cfg) or {}).get("lora")
    return LoraSpec() if node is None else _to_object(OmegaConf.create(node), LoraSpec, "model.lora")


def target_linear_layers(model: torch.nn.Module, patterns) -> list[str]:
    """The ``nn.Linear`` modules at or under a module matching a pattern; a pattern matching none is an error."""
    names = [name for name, _ in model.named_modules() if name]
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for pattern in patterns:
        if not any(_matches(name, pattern) for name in names):
            raise ConfigError(f"model.lora.target_modules: pattern {pattern!r} matches no module (names look like "
                              f"{linear[0]!r})")
        if not any(_matches(name, pattern) for name in linear):
            raise ConfigError(f"model.lora.target_modules: pattern {pattern!r} has no nn.Linear at or under it")
    return [name for name in linear if any(_matches(name, p) for p in patterns)]


def lora_config(model: torch.nn.Module, spec: LoraSpec) -> LoraConfig:
    """peft's config of ``spec`` on ``model``: the target patterns resolved to the exact linear layers."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in spec.modules_to_save:
        if pattern not in names:
            raise ConfigError(f"model.lora.modules_to_save: {pattern!r} is not a module name (e.g. 'lm_head')")
    return LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.dropout,
                      target_modules=target_linear_layers(model, spec.target_modules),
                      modules_to_save=list(spec.modules_to_save) or None)


def add_adapters(model: torch.nn.Module, spec: LoraSpec, seed: int = 0) -> torch.nn.Module:
    """``model`` with ``spec``'s adapters injected in place and everything else frozen; the same model back when
    ``spec`` is off. The adapters' random init is seeded and leaves the caller's RNG where it was."""
    if not spec.enabled:
        return model
    config = lora_config(model, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _peft_model(model, config)
    return model


def _peft_model(model: torch.nn.Module, config: LoraConfig):
    """``get_peft_model`` without the FutureWarning peft 0.21 triggers on every call by reading transformers'
    deprecated ``is_gradient_checkpointing``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def idle_modules(model: torch.nn.Module) -> set[str]:
    """Modules peft keeps but never runs: the frozen original of each ``modules_to_save`` module, whose trained copy
    computes in its place (the FLOPs count leaves them out)."""
    return {f"{name}.original_module" for name, module in model.named_modules()
            if isinstance(module, ModulesToSaveWrapper)}


def running_module(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module that computes for ``module``: the trained copy when it is a ``modules_to_save`` wrapper."""
    if isinstance(module, ModulesToSaveWrapper):
        return module.modules_to_save[module.active_adapters[0]]
    return module


def save_adapters(build: Callable[[], torch.nn.Module], spec: LoraSpec, state_dict: dict[str, torch.Tensor],
                  directory: Path) -> list[Path]:
    """Write the trained adapters from ``state_dict`` (the whole model's, as gathered for saving) to ``directory``
    as a peft adapter folder, and with ``merge_on_save`` the merged model to ``directory/merged``; returns the
    folders written. ``build`` makes the recipe's model (a ``pretrained`` one without its weights)."""
    with pretrained_without_weights():
        base = build()
    pretrained = base.name_or_path  # the folder a pretrained base came from; "" for a fresh init
    if not pretrained:
        # the seeded init the run trained on (LoRA leaves the base frozen): no path names it, so it goes along
        base.save_pretrained(directory)
    peft_model = _peft_model(base, lora_config(base, spec))
    peft_model.peft_config["default"].base_model_name_or_path = str(Path(pretrained).resolve()) if pretrained else None
    own = peft_model.base_model.model.state_dict()
    if any(key not in own for key in state_dict):
        # a quantized base (model.quantization): its packed codes and constants are not the base built here, which
        # is the one the run quantized (the seeded init or the pretrained weights, unquantized); the adapters and any
        # modules_to_save copy are what trained
        state_dict = {key: value for key, value in state_dict.items()
                      if key in own and own[key].shape == value.shape}
        peft_model.base_model.model.load_state_dict(state_dict, strict=False, assign=True)
    else:
        peft_model.base_model.model.load_state_dict(state_dict, assign=True)
    peft_model.save_pretrained(directory)
    if not spec.merge_on_save:
        return [directory]
    # safe_merge writes each merged weight into a new tensor: the loaded ones are the caller's (assign=True)
    peft_model.merge_and_unload(safe_merge=True).save_pretrained(directory / MERGED)
    return [directory, directory / MERGED]


def check_adapter_base(directory: str | Path) -> None:
    """``model.pretrained=<adapter folder>``: its base must be on this machine, saved beside the adapters or at the
    folder its config names, else transformers would look for it on the model hub. One line naming the folder and
    what to do; nothing for a folder that is not an adapter folder."""
    folder = Path(directory)
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / BASE_CONFIG).is_file():
        return
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"model.pretrained={folder}: the adapter folder holds no base model and its "
                          f"{ADAPTER_CONFIG} names none (saved before adapters carried their base): evaluate "
                          f"{folder / MERGED} if the run saved one (model.lora.merge_on_save=true), or retrain")
    if not Path(base).is_dir():
        raise ConfigError(f"model.pretrained={folder}: the adapters' base {base} (base_model_name_or_path in "
                          f"{ADAPTER_CONFIG}) is not a folder on this machine: put the base model there")
