"""``train.sharding=fsdp2``: torch's FSDP2 (``fully_shard``) over the data-parallel ranks, on CUDA or on the CPU.

The engine calls ``fully_shard`` itself instead of handing the model to ``accelerator.prepare``: accelerate 1.15
silently ignores its FSDP2 plugin on a CPU machine and wraps the model in DDP (also under ``accelerate launch
--config_file conf/accelerate/fsdp2.yaml``), while ``fully_shard`` called directly shards over gloo as over NCCL, so
one code path is exact and tested everywhere. One sharding unit per block the model declares unsplittable
(``_no_split_modules``: decoder layers, vision blocks), then the root (embeddings, heads, norms, projector).

Whole-model state dicts go through ``torch.distributed.checkpoint.state_dict``: the final ``save_pretrained``
gathers to rank 0 with CPU offload, and a pretrained model is read by rank 0 alone and broadcast into the shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mvp_engine.packing.collective_device import collective_device

from .config import ConfigError
from .expert_parallel import is_split, split_squares


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """``train.mixed_precision`` under FSDP2: ``bf16`` computes in bf16 from fp32 master weights and reduces
    gradients in fp32; ``no``: everything in the parameters' own dtype (fp16 is refused by ``TrainSpec``)."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def sharding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of the classes in ``model._no_split_modules``, innermost first; one line when there are none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not units:
        raise ConfigError(f"train.sharding=fsdp2: {type(model).__name__} declares no blocks to shard "
                          "(_no_split_modules is empty or matches no module); use train.sharding=none")
    return units[::-1]


def offload_policy(offload: str) -> OffloadPolicy:
    """``train.offload`` under FSDP2: ``params`` keeps every shard, its gradient and (since the optimizer is built
    over the shards) the optimizer state in host memory, copying each unit to the device for its forward and
    backward and running the optimizer step on the host (pinned host memory where CUDA is there to copy to);
    ``none``: all on the device."""
    if offload == "params":
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


def shard_model(model: torch.nn.Module, mixed_precision: str, mesh=None, offload: str = "none") -> torch.nn.Module:
    """Shard ``model`` in place over ``mesh``, a one-dim device mesh (a run's is its layout's ``world_mesh``:
    ``parallel.py`` owns the one mesh, so a second one built here could not line up with its dims), and return it;
    ``offload`` (``train.offload``): :func:`offload_policy`.

    Parameters become ``DTensor`` shards: build the optimizer after this call."""
    if not torch.distributed.is_initialized():
        raise ConfigError("train.sharding=fsdp2 needs several processes: launch with torchrun --nproc_per_node N or "
                          "accelerate launch --config_file conf/accelerate/fsdp2.yaml")
    units = sharding_units(model)
    if mesh is None:
        raise ValueError("shard_model needs the device mesh to shard over (the run's: ParallelLayout.world_mesh)")
    # fully_shard moves the shards onto the mesh's device (the current CUDA device, as the launcher set it)
    policy, host = mixed_precision_policy(mixed_precision), offload_policy(offload)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=host)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=host)
    return model


def describe_sharding(model: torch.nn.Module, subject: str = "sharding") -> str:
    """The start-of-run line: what this rank really holds of ``model`` (``subject``: what the line is about)."""
    local = sum(_local(p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    where = ", offloaded to host memory with their gradients and optimizer state" if offloaded(model) else ""
    return (f"{subject}: fsdp2 over {torch.distributed.get_world_size()} ranks, this rank holds {local:,} of "
            f"{total:,} parameter elements{where}")


def offloaded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 keeps ``model``'s shards on the host (``train.offload=params``)."""
    state = model._get_fsdp_state() if isinstance(model, FSDPModule) else None
    group = getattr(state, "_fsdp_param_group", None)
    return isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 root (its parameters are shards, its state dicts need collectives)."""
    return isinstance(model, FSDPModule)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm and return it (before clipping); sharded (``DTensor``) gradients are summed
    over every rank's shards (one all-reduce), whole ones are taken as they are (DDP has averaged them).

    Squares summed in float64, sharded or not: a float32 norm of a 200k-element gradient on the CPU was off by
    1.3e-5 relative, and shards sum in another order than the whole tensor, so float32 norms of the same gradients
    differed by 1e-4 between a sharded and an unsharded run. The gradients themselves are not upcast (a float64 copy
    of a 7B model's embedding gradient is 4.4 GB): :func:`_block_norms` takes fp32 norms of short blocks, whose
    squares are summed in float64, within fp32 rounding of the exact norm."""
    parameters = [p for p in parameters if p.grad is not None]
    first = parameters[0].grad
    blocks = [_block_norms(_local(p.grad)) for p in parameters if not is_split(p)]
    squares = torch.cat(blocks).double().square().sum()
    if isinstance(first, DTensor):  # fully_shard's placement: Shard(0) over the mesh
        group = first.device_mesh.get_group()
        squares = squares.to(collective_device(group))
        torch.distributed.all_reduce(squares, group=group)
    split = split_squares(parameters, _block_norms)  # experts split over ranks under DDP (expert_parallel.py)
    if split is not None:
        squares = squares + split.to(squares.device)
    total = squares.sqrt().float()
    meshes: dict = {}  # one call per device mesh: torch's foreach ops cannot take DTensors of several meshes
    for p in parameters:  # (experts split over ranks are sharded over their replicas' mesh: expert_parallel.py)
        meshes.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group_parameters in meshes.values():
        torch.nn.utils.clip_grads_with_norm_(group_parameters, max_norm, total)
    return total


NORM_BLOCK = 1024  # elements per fp32 partial norm


def _block_norms(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 norms of ``grad``'s consecutive blocks of :data:`NORM_BLOCK` elements (the last one shorter), read
    in place: no copy of ``grad``, one float per block. Why blocks and not one fp32 norm per tensor: torch's CPU
    norm accumulates in fp32 along the whole tensor and drifts with its length (4e-6 relative at 200k elements,
    6e-5 at 3M); over 1024 elements it stays within fp32 rounding."""
    flat = grad.reshape(-1)
    whole = flat.numel() - flat.numel() % NORM_BLOCK
    norms = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_BLOCK), dim=1, dtype=torch.float32)
    if whole < flat.numel():
        norms = torch.cat([norms, torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1)])
    return norms


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered, on the CPU of rank 0 (other ranks get ``{}``); every rank takes part. A
    tied parameter (Gemma's ``lm_head.weight`` is its embedding) comes once, under its first name: the gathered
    copies share no storage, so ``save_pretrained`` would write both, unlike an unsharded save."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tied = ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {name for name, _ in model.named_parameters()})
    return {name: tensor for name, tensor in state.items() if name not in tied}


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                         keep: tuple[str, ...] = ()) -> None:
    """Rank 0's full ``state_dict`` broadcast into every rank's shards (the others pass ``{}`` and may have been
    built on the meta device: their shards are allocated here). ``keep``: names every rank already holds its own
    part of (experts split over ranks, ``expert_parallel.experts_from_rank0``): left out, the check that every
    other name is there relaxed with them."""
    state_dict = {name: value for name, value in state_dict.items() if name not in keep}
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                     strict=not keep))


@contextmanager
def own_class(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` as its own class while inside: ``fully_shard`` swaps it for a generated ``FSDP<Class>`` subclass,
    and transformers' ``save_pretrained`` chooses the checkpoint's key layout by class name, so a sharded model
    would save another layout than an unsharded one. A no-op for an unsharded model."""
    sharded_class = type(model)
    if is_sharded(model):
        model.__class__ = next(c for c in sharded_class.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = sharded_class
