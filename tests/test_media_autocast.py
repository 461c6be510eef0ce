"""The media passes that run before the model's forward (dummy passes, context parallelism's media encoding) run
under the autocast accelerate wraps that forward in: under ``mixed_precision=bf16`` they ran in fp32 (a forward
pre-hook runs outside it), which flash kernels in a vision tower refuse on a GPU, and on the CPU too showed as
fp32 vision-tower outputs beside the real images' bf16 ones."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import TrainSpec
from mvp_engine.engine.participation import dummy_media_loss, forward_with_media_pass, media_kinds
from mvp_engine.engine.train_step import TrainStep


def _float_dtypes(value) -> set[torch.dtype]:
    if isinstance(value, torch.Tensor):
        return {value.dtype} if value.is_floating_point() else set()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return set().union(*(_float_dtypes(item) for item in items))


def test_media_passes_compute_in_the_forwards_bf16():
    """Qwen2-VL (images and videos, one tower) on a text-only micro-batch: the step's two dummy passes, and an
    ``encode`` run where context parallelism's runs, return bf16 from the vision tower, as the model's own image
    pass does."""
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        recipe = kit.load_recipe("qwen2_vl")
        model = recipe.build_model(kit.compose_config("qwen2_vl").model, "sdpa")
        dummy, kinds = recipe.dummy_media(model), media_kinds(model)
        prepared = accelerator.prepare_model(model)
        step = TrainStep(accelerator, lambda batch, _model, _attention: {**batch, "use_cache": False}, "sdpa",
                         dummy, TrainSpec(), kinds)
        dtypes = []
        hook = model.model.visual.register_forward_hook(lambda _m, _a, out: dtypes.append(_float_dtypes(out)))
        ids = torch.tensor([[1, 2, 3]])
        try:
            _, zero = step.forward(prepared, {"input_ids": ids})
            _, encoded = forward_with_media_pass(prepared, {"input_ids": ids, "use_cache": False}, dummy, 0,
                                                 encode=lambda module: ({}, dummy_media_loss(module, dummy)),
                                                 autocast=step.forward_autocast(prepared))
            with accelerator.autocast():  # the model's own pass over an image, for comparison
                dummy_media_loss(model, dummy)
        finally:
            hook.remove()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert len(dtypes) == 4 and float(zero.detach()) == float(encoded.detach()) == 0.0
    assert dtypes == [{torch.bfloat16}] * 4, dtypes
