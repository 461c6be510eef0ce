"""``train.loss_impl=liger | cce``: the fused linear cross-entropy kernels of Liger-Kernel and Cut Cross-Entropy, as
CUDA-only options of the loss ``linear_loss.py`` computes in torch.

Why options and not the default: both are Triton kernels (none runs on the CPU, where the project is tested), and
both have exactness traps this project's per-token weights (``sample`` / ``square`` reductions) walk into:
Liger's fused loss multiplied every gradient by the first token's upstream gradient under ``reduction="none"``
until its fix (``token_grad_output``) shipped in 0.8.2, and Cut Cross-Entropy drops small gradient entries unless
``filter_eps=None``. So: Liger >= :data:`LIGER_MIN` with ``reduction="none"`` and fp32 accumulation, CCE with
``filter_eps=None``; each returns per-token losses that are weighted here exactly as the chunked loss weights its
log-probabilities. ``tools/gpu_check.py`` (probe ``fused-losses``) compares them with ``chunked`` on a GPU.

Both take the head's weight matrix, so the head must be a plain linear layer without bias (a tied embedding is
one; a LoRA-wrapped head, a ``modules_to_save`` copy or an FSDP2 shard are not): anything else is refused in one
line naming ``train.loss_impl=chunked``. Imports are lazy: the packages are optional extras (``.[liger]``,
``.[cce]``).
"""

from __future__ import annotations

from importlib import metadata

import torch
from packaging.version import Version
from torch.distributed.tensor import DTensor

from .config import ConfigError
from .loss import WeightedTokenLoss, token_weights

LIGER_MIN = "0.8.2"  # the first release with the per-token upstream gradient of reduction="none" (PR #1298)
PACKAGES = {"liger": ("liger-kernel", "liger"), "cce": ("cut-cross-entropy", "cce")}
CHUNKED = "use train.loss_impl=chunked"


def check_head(head: torch.nn.Module, impl: str) -> None:
    """One line unless ``head`` is a plain linear layer without bias whose weight is a whole tensor."""
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"train.loss_impl={impl} takes the head's weight matrix and the head is a "
                          f"{type(head).__name__} (a LoRA-adapted or modules_to_save head computes more); {CHUNKED}")
    if head.bias is not None:
        raise ConfigError(f"train.loss_impl={impl}: the output head has a bias; {CHUNKED}")
    if isinstance(head.weight, DTensor):
        raise ConfigError(f"train.loss_impl={impl}: the output head is an FSDP2 shard; {CHUNKED}")


def _package(impl: str):
    """The kernel's loss callable ``(rows [N, H], weight [V, H], targets [N], softcap) -> losses [N]``, imported
    now; one line when the package is missing or (Liger) too old."""
    name, extra = PACKAGES[impl]
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"train.loss_impl={impl} needs {name}, an optional extra: pip install -e '.[{extra}]'") \
            from None
    if impl == "liger":
        if Version(version) < Version(LIGER_MIN):
            raise ConfigError(f"train.loss_impl=liger needs liger-kernel >= {LIGER_MIN} (earlier fused losses give "
                              f"wrong weight gradients with per-token weights), found {version}")
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        def liger(rows, weight, targets, softcap):
            loss = LigerFusedLinearCrossEntropyLoss(reduction="none", softcap=softcap, accum_dtype=torch.float32)
            return loss(weight, rows, targets)

        return liger
    from cut_cross_entropy import linear_cross_entropy

    def cce(rows, weight, targets, softcap):
        return linear_cross_entropy(rows, weight, targets, softcap=softcap, reduction="none", filter_eps=None)

    return cce


def fused_token_loss(impl: str, rows: torch.Tensor, targets: torch.Tensor, flat: torch.Tensor,
                     head: torch.nn.Linear, labels: torch.Tensor, segment_ids: torch.Tensor, reduction: str,
                     span: tuple[int, int] | None, softcap: float | None) -> WeightedTokenLoss:
    """:func:`.linear_loss.chunked_token_loss`'s result through ``impl``'s kernel: the supervised ``rows`` and
    their ``targets`` (``flat``: their indices into the flattened positions), their per-token losses weighted by
    ``token_weights``."""
    losses = _package(impl)(rows.contiguous(), head.weight.to(rows.dtype), targets, softcap)
    weights = token_weights(labels, segment_ids, reduction, span)
    return WeightedTokenLoss((losses.float() * weights.reshape(-1)[flat].float()).sum(), weights.sum())
