"""The cost model against torch's FLOP counter: a recipe's tiny model, a packed micro-batch with media, eager.

``check_flop_count`` builds the recipe's equivalence case (two packed rows of real encoded records, images, text-only
samples and, where the encoder takes video, a clip; both rows end in padding), runs one forward and backward of the
token-mean loss under ``torch.utils.flop_counter.FlopCounterMode`` on the eager backend (the counter has no formula
for CPU fused sdpa, so other backends would count attention as 0), and compares with ``flops.batch_flops``' executed
FLOPs of the same batch. One correction to the counter: its ``convolution_backward`` formula ignores ``groups``
("skipped for brevity" in torch's source), which overcounts a depthwise conv1d (linear-attention layers) by its
channel count; a groups-aware formula (each of grad input and grad weight costs the forward) replaces it. One
addition: the counter has no formula for ``aten._grouped_mm`` (mixture-of-experts layers under
``experts_implementation=grouped_mm``, forward and both backward products), so it would count their experts as 0;
:func:`_grouped_mm_flop` counts each call as the matmuls it groups.
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


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._grouped_mm(a, b, offs)`` with ``a`` 2-D: the groups split a's rows (``[S, K] x [E, K, N]``, the
    forward and the input gradient) or its columns (``[K, S] x [S, N]`` into ``[E, K, N]``, the weight gradient);
    either way every element of ``a`` meets one ``N``-wide row of ``b``: 2 x numel(a) x N."""
    if len(a_shape) != 2:
        raise NotImplementedError(f"grouped_mm of a {len(a_shape)}-D left operand is not counted")
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


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
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flop,
                                                             torch.ops.aten._grouped_mm: _grouped_mm_flop})
    with counter:
        logits = model(**case.recipe.prepare_packed(case.batch, model, BACKEND)).logits
        counted_forward = counter.get_total_flops()
        part = weighted_token_loss(logits, case.batch["labels"], case.batch["pack_segment_ids"], "token")
        (part.weighted_sum / part.weight_total).backward()
    forward = sum(p["forward"] for p in profile.breakdown(ours.executed_units).values())
    planning = planning_cost_profile(case.recipe, model_cfg)
    return FlopCheck(name, counter.get_total_flops(), counted_forward, ours.executed, forward, ours.useful,
                     planning == profile)
