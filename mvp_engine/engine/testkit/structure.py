"""Structure checks: a recipe composes, exposes its hooks, and validates every packing x attention combination."""

from __future__ import annotations

import copy
import importlib
import inspect

from mvp_engine.kit.mllm.data import MLLMSampleEncoder
from mvp_engine.packing import ATTENTION_BACKENDS, BACKENDS, is_flash

from ..config import backward_available as backward_available  # re-exported: these three live in the engine,
from ..config import check_attention, compose_config, resolve_run_specs  # where tools import them from
from ..recipe import Recipe, load_recipe

PACKINGS = (None, "greedy", "bfd")


def packing_overrides(packing: str | None) -> list[str]:
    return [] if packing is None else [f"+packing={packing}"]


def check_structure(name: str) -> None:
    """Entry point, hooks and the encoder protocol are in place."""
    module = importlib.import_module(f"recipes.{name}.train")
    assert callable(getattr(module, "main", None)), f"recipes.{name}.train has no main()"
    recipe = module.RECIPE
    assert recipe.name == name
    for hook in ("prepare_packed", "prepare_padded"):
        params = list(inspect.signature(getattr(recipe, hook)).parameters)
        assert params[:3] == ["batch", "model", "attn_implementation"], f"{hook} signature is {params}"
    cfg = compose_config(name)
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    assert isinstance(encoder, MLLMSampleEncoder), "the encoder lacks encode/measure"


def needs_cuda(backend: str, training: bool = True) -> bool:
    """Whether running ``backend`` (``training``: forward and backward) needs a CUDA device: a flash package's
    kernels always, torch's FlexAttention to train (no CPU backward). The suites mark such cases ``gpu``: on a GPU
    machine they alone see CUDA, every other test runs as on a CPU machine (``conftest.py``)."""
    spec = BACKENDS[backend]
    return spec.package is not None or (training and spec.needs_cuda)


def runnable_backends(recipe: Recipe, training: bool = True) -> list[str]:
    """The recipe's attention backends this machine can train with (``training=False``: run forward only)."""
    usable = []
    for backend in recipe.attention_backends:
        try:
            check_attention(backend, recipe.attention_backends, training=training)
        except ValueError:
            continue
        usable.append(backend)
    return usable


def forward_backends(recipe: Recipe) -> list[str]:
    """The recipe's backends whose forward this machine runs in fp32 (flash needs CUDA and half precision, so it
    is never one of these: its kwargs are checked on CPU by ``check_flash_kwargs_with_reference_attention``)."""
    return [b for b in runnable_backends(recipe, training=False) if not is_flash(b)]


def check_all_combinations_compose(name: str) -> int:
    """Every packing x attention combination of the recipe's config validates where this machine runs the backend
    and fails naming the key where it cannot. One composition per packing, the backend set on a copy: choosing an
    ``attention=<backend>`` group sets exactly that key, for every recipe alike (``tests/test_config_defaults.py``
    composes each group)."""
    recipe = load_recipe(name)
    runnable = runnable_backends(recipe)
    checked = 0
    for packing in PACKINGS:
        composed = compose_config(name, packing_overrides(packing))
        assert (composed.get("packing") is None) == (packing is None)
        for backend in ATTENTION_BACKENDS:
            cfg = copy.deepcopy(composed)
            cfg.attention.implementation = backend
            if backend in runnable:
                specs = resolve_run_specs(cfg, recipe.attention_backends)
                assert (specs.data.packing is None) == (packing is None)
                if packing is not None:
                    assert specs.data.packing.strategy == packing
                    assert specs.data.packing.max_seq_len == specs.data.max_seq_len
            else:
                try:
                    resolve_run_specs(cfg, recipe.attention_backends)
                except ValueError as err:
                    assert "attention.implementation" in str(err)
                else:
                    raise AssertionError(f"attention={backend} validated on a machine that cannot run it")
            checked += 1
    return checked
