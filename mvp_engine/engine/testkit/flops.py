"""The cost model against torch's FLOP counter: a recipe's tiny model, a packed micro-batch with media, eager.

``check_flop_count`` builds the recipe's equivalence case (two packed rows of real encoded records, images, text-only
samples and, where the encoder takes video, a clip; both rows end in padding), runs one forward and backward of the
token-mean loss under ``torch.utils.flop_counter.FlopCounterMode`` on the eager backend (the counter has no formula
for CPU fused sdpa, so other backends would count attention as 0), and compares with ``flops.batch_flops``' executed
FLOPs of the same batch. One correction to the counter: its ``convolution_backward`` formula ignores ``groups``
("skipped for brevity" in torch's source), which overcounts a depthwise conv1d (linear-attention layers) by its
channel count; a groups-aware formula (each of grad input and grad weight costs the forward) replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from ..builders import to_plain
from ..flops import batch_flops, planning_cost_profile, recipe_cost_profile
from ..lora import add_adapters, lora_spec
from ..loss import weighted_token_loss
from ..participation import freeze_parameters
from .equivalence import equivalence_case

BACKEND = "eager"


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _op,
                        _groups, output_mask, out_shape=None, **kwargs) -> int:
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)  # groups-aware via w_shape
    return forward * (int(output_mask[0]) + int(output_mask[1]))


@dataclass
class FlopCheck:
    recipe: str
    counted: int
    counted_forward: int
    executed: int
    executed_forward: int
    useful: int
    planning_profile_matches: bool

    @property
    def relative_error(self) -> float:
        return self.executed / self.counted - 1

    @property
    def forward_relative_error(self) -> float:
        return self.executed_forward / self.counted_forward - 1

    def line(self) -> str:
        return (f"{self.recipe}: executed {self.executed:,} vs FlopCounterMode {self.counted:,} "
                f"({self.relative_error:+.2%}; forward {self.forward_relative_error:+.2%}), useful {self.useful:,}")


def check_flop_count(name: str, workdir: Path, freeze: tuple[str, ...] = (), lora: dict | None = None) -> FlopCheck:
    """``freeze``: ``model.freeze`` patterns (backward FLOPs depend on what trains); ``lora``: ``model.lora`` keys
    set over the recipe's (adapters on a frozen base)."""
    case = equivalence_case(name, workdir)
    model_cfg = {**to_plain(case.model_cfg), "freeze": list(freeze)}
    model_cfg["lora"] = {**model_cfg.get("lora", {}), **(lora or {})}
    model = add_adapters(case.recipe.build_model(case.model_cfg, BACKEND), lora_spec(model_cfg)).train()
    freeze_parameters(model, list(freeze), case.recipe.unreachable_parameters(model))  # as the trainer does
    profile = recipe_cost_profile(case.recipe, model)
    ours = batch_flops(profile, case.batch, BACKEND)
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flop})
    with counter:
        logits = model(**case.recipe.prepare_packed(case.batch, model, BACKEND)).logits
        counted_forward = counter.get_total_flops()
        part = weighted_token_loss(logits, case.batch["labels"], case.batch["pack_segment_ids"], "token")
        (part.weighted_sum / part.weight_total).backward()
    forward = sum(p["forward"] for p in profile.breakdown(ours.executed_units).values())
    planning = planning_cost_profile(case.recipe, model_cfg)
    return FlopCheck(name, counter.get_total_flops(), counted_forward, ours.executed, forward, ours.useful,
                     planning == profile)
