"""Activation checkpointing recomputes, and changes nothing it computes.

On the recipe's packed case (``equivalence_case``: rows of image, text-only, multi-image and video samples ending
in padding), in train mode (the tiny models' dropout is 0), the packed forward + token loss + backward runs twice
on the same seeded weights, without and with ``enable_activation_checkpointing``. Compared: the loss and every
parameter gradient (max abs difference <= ``RECOMPUTE_TOL``, 1e-6, in fp32). Proved, so the check could fail: every
layer the loss reaches (it ran in the forward and its parameters got a gradient; LLaVA's last CLIP layer feeds no
feature) ran again in the backward (a forward pre-hook on its children fires during ``backward()``), none did
without checkpointing, and the bytes saved for backward (``SavedForBackward``) fell. On the CPU, or on CUDA for a
backend that trains only there (flex: no CPU backward; flash: in bf16, which it needs, within
``LOW_PRECISION_TOL``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mvp_engine.packing import is_flash

from ..loss import weighted_token_loss
from ..recompute import SavedForBackward, checkpointing_layers, enable_activation_checkpointing
from .equivalence import LOW_PRECISION_TOL, EquivalenceCase, batch_to
from .structure import needs_cuda

RECOMPUTE_TOL = 1e-6


@dataclass
class PackedBackward:
    """One packed forward + backward: its loss, gradients, saved bytes, the layers the loss reached (ran forward,
    got gradients) and those that ran again in the backward."""

    loss: float
    grads: dict[str, torch.Tensor]
    saved_bytes: int
    reached_layers: frozenset[int]
    backward_layers: frozenset[int]


def packed_backward(case: EquivalenceCase, backend: str, checkpointing: bool, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> PackedBackward:
    model = case.recipe.build_model(case.model_cfg, backend).to(device=device, dtype=dtype).train()
    batch = batch_to(case.batch, device)
    if checkpointing:
        enable_activation_checkpointing(model)
    layers = checkpointing_layers(model)
    ran: dict[str, set[int]] = {"forward": set(), "backward": set()}
    phase = ["forward"]

    def called(index: int):
        return lambda *_: ran[phase[0]].add(index)

    handles = [child.register_forward_pre_hook(called(index))
               for index, layer in enumerate(layers) for child in layer.children()]
    try:
        with SavedForBackward(model) as saved:
            outputs = model(**case.recipe.prepare_packed(batch, model, backend))
            part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token")
            loss = part.weighted_sum / part.weight_total
            saved_bytes = saved.bytes
        phase[0] = "backward"
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    reached = {i for i in ran["forward"] if any(p.grad is not None for p in layers[i].parameters())}
    return PackedBackward(float(loss.detach()), grads, saved_bytes, frozenset(reached), frozenset(ran["backward"]))


@dataclass
class RecomputeReport:
    recipe: str
    backend: str
    plain: PackedBackward
    recomputed: PackedBackward
    tol: float = RECOMPUTE_TOL

    @property
    def loss_diff(self) -> float:
        return abs(self.plain.loss - self.recomputed.loss)

    @property
    def grad_diff(self) -> float:
        """Max abs difference over every gradient; inf when the two runs gave different parameters a gradient."""
        if self.plain.grads.keys() != self.recomputed.grads.keys():
            return float("inf")
        return max((self.plain.grads[n] - g).abs().max().item() for n, g in self.recomputed.grads.items())

    @property
    def saved_ratio(self) -> float:
        return self.recomputed.saved_bytes / self.plain.saved_bytes

    def failures(self) -> list[str]:
        plain, recomputed = self.plain, self.recomputed
        out = []
        if not self.grad_diff <= self.tol:
            out.append(f"gradients: max abs diff {self.grad_diff:.3e} (with a gradient only one way: "
                       f"{sorted(plain.grads.keys() ^ recomputed.grads.keys())})")
        if not self.loss_diff <= self.tol:
            out.append(f"loss: {plain.loss:.8f} without, {recomputed.loss:.8f} with recomputation")
        if not (recomputed.reached_layers and recomputed.backward_layers == recomputed.reached_layers):
            out.append(f"{len(recomputed.backward_layers)} layers ran again in backward, the loss reached "
                       f"{len(recomputed.reached_layers)} (not the same ones)")
        if plain.backward_layers:
            out.append(f"{len(plain.backward_layers)} layers ran in backward without recomputation")
        if not recomputed.saved_bytes < plain.saved_bytes:
            out.append(f"saved for backward: {recomputed.saved_bytes} bytes with, {plain.saved_bytes} without")
        return out

    def lines(self) -> list[str]:
        verdict = "OK" if not self.failures() else "FAILED: " + "; ".join(self.failures())
        return [f"{self.recipe} / {self.backend}: activation checkpointing vs none",
                f"  loss diff {self.loss_diff:.3e}, max grad diff {self.grad_diff:.3e} over "
                f"{len(self.recomputed.grads)} parameters",
                f"  layers recomputed in backward {len(self.recomputed.backward_layers)}, reached by the loss "
                f"{len(self.recomputed.reached_layers)}; saved for backward {self.plain.saved_bytes} -> "
                f"{self.recomputed.saved_bytes} bytes ({self.saved_ratio:.2f}x)",
                f"  {verdict}"]

    def check(self) -> None:
        assert not self.failures(), "\n".join(self.lines())


def run_recompute_check(case: EquivalenceCase, backend: str) -> RecomputeReport:
    """The packed case on ``backend`` without and with activation checkpointing (see the module doc), on the
    device ``backend`` trains on (``needs_cuda``): a CPU model on a GPU machine would still have no flex backward and
    no flash kernel."""
    device = "cuda" if needs_cuda(backend) else "cpu"
    dtype = torch.bfloat16 if is_flash(backend) else torch.float32
    runs = [packed_backward(case, backend, checkpointing, device, dtype) for checkpointing in (False, True)]
    return RecomputeReport(case.recipe.name, backend, *runs,
                           tol=RECOMPUTE_TOL if dtype == torch.float32 else LOW_PRECISION_TOL)
