"""``train.expert_parallel_size=N``: each MoE layer's experts split over N ranks, tokens sent to their experts' ranks
with all-to-all, composed with DDP or FSDP2 over the other ranks, on the run's one device mesh.

Layout: the world (DP x CP) is unflattened into (``edp``, ``ep``), EP innermost (ranks ``g*N .. g*N + N-1`` form an
EP group, as torchtitan lays it out; under CP an EP group may be a CP group: tokens are tokens). EP rank ``i`` keeps
experts ``i*E/N .. (i+1)*E/N - 1`` of every layer; the ``edp`` ranks keep the same experts and hold different
tokens. Every rank routes its own tokens (the routers are not split), so the load-balancing counts of
``router_balance`` stay this rank's real tokens, summed over all ranks once per step, as without EP.

The dispatch is transformers' own: ``transformers.distributed.expert_parallel.AllToAllEP`` (sort the (token, expert)
pairs by expert, an all-to-all of the counts, the rows exchanged with torch's differentiable
``all_to_all_single_autograd``, the experts run on local ids, the outputs sent back and weighted on the sender; its
backward sends each token's gradient home). It runs on gloo and the CPU (measured: forward and backward on 2 ranks).
What is not used is the rest of transformers' EP: ``DistributedConfig(ep_size=...)`` applies only inside
``from_pretrained``, builds its own meshes (pp, dp_replicate, fsdp, tp / efsdp, ep; no CP dim) and its own FSDP2,
and makes the experts DTensors over its EP mesh, which DDP cannot reduce; the engine's ``parallelize`` owns the mesh,
CP and FSDP2 / DDP. So the experts are sliced here as plain parameters (the slice of the full, identically seeded
weights each rank built) and their gradients handled where the wrapper would get them wrong:

- a rank's expert gradient is already the sum over its EP group's tokens (the all-to-all's backward brings them),
  each token's loss scaled by the world size (``train_step``), so it is summed over the ``edp`` ranks and divided
  by the world size: FSDP2 shards each experts module over the ``edp`` mesh with that divide factor; under DDP the
  expert parameters are left out of DDP's all-reduce and a gradient hook does it;
- the gradient norm sums an expert parameter's squares over its EP group (``split_group``; ``sharding``);
- the final save gathers each expert weight over the EP group (:func:`full_experts`) and saves with the whole
  weights in the model (:func:`saved_whole`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from mvp_engine.packing.collective_device import collective_device

from .config import ConfigError

KEY = "train.expert_parallel_size"
EDP, EP, ETP = "edp", "ep", "etp"  # the world unflattened: expert replicas, expert split, one rank (no expert TP)
SPLIT_GROUP = "_expert_parallel_group"  # on a split expert parameter and its module: the group of its slices
SPLIT_NAMES = "_expert_parallel_names"  # on an experts module: its split parameters' names


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's part of the experts: EP rank ``rank`` of ``size``, ``names`` the split parameters (as the
    unwrapped model names them), ``mesh`` the (edp, ep, etp) view of the run's mesh."""

    size: int
    rank: int
    names: tuple[str, ...]
    mesh: DeviceMesh


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """transformers' experts modules (the classes ``use_experts_implementation`` decorates: 3-D weights over
    ``num_experts``, called with (hidden states, top-k ids, top-k weights))."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "_is_expert_parallel")
            and hasattr(m, "num_experts")]


def check_expert_parallel(size: int, world_size: int, model: torch.nn.Module) -> None:
    """One line naming :data:`KEY` where ``size`` cannot split ``model``'s experts over ``world_size`` ranks."""
    if size == 1:
        return
    if world_size % size:
        raise ConfigError(f"{KEY}={size} does not divide the {world_size} processes (EP groups are made of "
                          "data- / context-parallel ranks)")
    modules = expert_modules(model)
    if not modules:
        raise ConfigError(f"{KEY}={size} needs a mixture-of-experts model: {type(model).__name__} has no experts")
    for name, module in modules:
        if module.num_experts % size:
            raise ConfigError(f"{KEY}={size} does not divide the {module.num_experts} experts of {name}")


def expert_parallel(model: torch.nn.Module, layout, train, weights_from_rank0: bool = False) -> ExpertSplit | None:
    """``parallelize``'s step for a training run: ``model``'s experts split over ``train.expert_parallel_size``
    ranks of ``layout``'s mesh (None: no EP), after the checks (one line each)."""
    size = train.expert_parallel_size
    if size == 1:
        return None
    check_expert_parallel(size, layout.world_size, model)
    if train.time_barrier:
        raise ConfigError(f"{KEY}={size} with train.time_barrier=true: its all-reduce would average different "
                          "experts; use one of them")
    if weights_from_rank0:
        experts_from_rank0(model)
    split = split_experts(model, layout.world_mesh, size)
    if layout.rank == 0:
        print(describe_experts(split, size * expert_modules(model)[0][1].num_experts))
    return split


def experts_from_rank0(model: torch.nn.Module) -> None:
    """A pretrained model under FSDP2 is read by rank 0 alone (the others built it on the meta device and receive
    the rest from rank 0's state dict, ``sharding.load_full_state_dict``): each whole expert weight is broadcast from
    rank 0 first, one at a time, so every rank can keep its own slice (the state dict broadcast after the split
    would hand out rank 0's slices: ``parallelize`` leaves the experts out of it)."""
    device = collective_device()
    for _, module in expert_modules(model):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] != module.num_experts:
                continue
            whole = (param.detach().to(device).contiguous() if torch.distributed.get_rank() == 0
                     else torch.empty(param.shape, dtype=param.dtype, device=device))
            torch.distributed.broadcast(whole, src=0)
            setattr(module, name, torch.nn.Parameter(whole, requires_grad=param.requires_grad))


def split_experts(model: torch.nn.Module, world_mesh: DeviceMesh, size: int) -> ExpertSplit:
    """Keep this rank's experts of every experts module and route its tokens to the others with all-to-all."""
    from transformers.distributed.expert_parallel import AllToAllEP

    world = world_mesh.size()
    mesh = world_mesh._unflatten(0, (world // size, size, 1), (EDP, EP, ETP))
    rank = mesh.get_local_rank(EP)
    group, names = mesh[EP].get_group(), []
    for prefix, module in expert_modules(model):
        local, split = module.num_experts // size, []
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] != module.num_experts:
                continue
            part = torch.nn.Parameter(param.detach()[rank * local:(rank + 1) * local].clone(),
                                      requires_grad=param.requires_grad)
            setattr(part, SPLIT_GROUP, group)
            setattr(module, name, part)
            split.append(name)
        module.num_experts = local  # the experts' own forward runs on local ids 0 .. local - 1
        # kept on the module too: FSDP2 replaces its parameters (DTensors, without the attribute)
        setattr(module, SPLIT_GROUP, group)
        setattr(module, SPLIT_NAMES, tuple(split))
        names += [f"{prefix}.{name}" for name in split]
        dispatch = AllToAllEP(module, mesh[EP], mesh[ETP])
        module.forward = _forward(dispatch)
    return ExpertSplit(size, rank, tuple(names), mesh)


def _forward(dispatch) -> Callable:
    def forward(hidden_states, top_k_index, top_k_weights):
        return dispatch(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)
    return forward


def shard_expert_replicas(model: torch.nn.Module, split: ExpertSplit, mixed_precision: str, offload: str) -> None:
    """FSDP2 over the ``edp`` ranks for each experts module (before the blocks around it are sharded over the
    world), with the run's policies: their gradients summed over the replicas and divided by the world size (module
    docstring)."""
    from torch.distributed.fsdp import fully_shard

    from .sharding import mixed_precision_policy, offload_policy

    world, policy, host = split.mesh.size(), mixed_precision_policy(mixed_precision), offload_policy(offload)
    for _, module in expert_modules(model):
        fully_shard(module, mesh=split.mesh[EDP], mp_policy=policy, offload_policy=host)
        module.set_gradient_divide_factor(world)
        # gloo has no PREMUL_SUM, what a custom factor reduces with; torch 2.13 then sums and divides after, but
        # over one replica it divides twice (the copy that stands for the reduce-scatter divides too): measured, the
        # gradients 1/world of what they are. So only where replicas reduce
        if "nccl" not in torch.distributed.get_backend() and split.mesh[EDP].size() > 1:
            module.set_force_sum_reduction_for_comms(True)


def exclude_from_ddp(model: torch.nn.Module, split: ExpertSplit) -> None:
    """Under DDP: the split experts out of DDP's all-reduce (it would average different experts), their gradients
    summed over the ``edp`` ranks and divided by the world size by a hook, one backward at a time (linear, so the
    same under gradient accumulation)."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(split.names))
    world, replicas = split.mesh.size(), split.mesh[EDP]
    group = replicas.get_group() if replicas.size() > 1 else None
    parameters = dict(model.named_parameters())
    for name in split.names:
        parameters[name].register_hook(_replica_mean(world, group))


def _replica_mean(world: int, group) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / world
        if group is not None:
            torch.distributed.all_reduce(grad, group=group)
        return grad
    return hook


def split_squares(parameters: list[torch.nn.Parameter], norms: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor | None:
    """The float64 sum of squares of the whole (not FSDP2-sharded) gradients of split expert parameters, summed over
    their EP groups (``norms``: the caller's fp32 block norms of a gradient); None when there are none."""
    groups: dict = {}
    for p in parameters:
        group = getattr(p, SPLIT_GROUP, None)
        if group is not None:
            groups.setdefault(group, []).append(norms(p.grad).double().square().sum())
    total = None
    for group, squares in groups.items():
        value = torch.stack(squares).sum().to(collective_device(group))
        torch.distributed.all_reduce(value, group=group)
        total = value if total is None else total + value
    return total


def is_split(param: torch.nn.Parameter) -> bool:
    return getattr(param, SPLIT_GROUP, None) is not None


def full_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every split expert weight gathered over its EP group (whole over the ``edp`` ranks first where FSDP2 shards
    it), on the CPU; every rank takes part and gets them (the caller keeps rank 0's)."""
    from torch.distributed.tensor import DTensor

    gathered = {}
    for prefix, module in expert_modules(model):
        group = getattr(module, SPLIT_GROUP, None)
        for name in getattr(module, SPLIT_NAMES, ()):
            param = getattr(module, name)
            local = param.full_tensor() if isinstance(param, DTensor) else param
            local = local.detach().to(collective_device(group)).contiguous()
            parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, local, group=group)
            gathered[f"{prefix}.{name}"] = torch.cat(parts).cpu()
    return gathered


@contextmanager
def saved_whole(model: torch.nn.Module, gathered: dict[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
    """``model`` with each split expert weight replaced by its whole (``gathered``: :func:`full_experts`) while
    inside, for transformers' ``save_pretrained`` to see the shapes it sees without EP. Why: its reverse weight
    conversions compare a tensor's shape with the model parameter's (Qwen3-VL-MoE's experts:
    ``Transpose(1, 2, check_dims=True)``) and transpose where they differ, so against a slice's shape the whole
    weight was saved transposed (measured: ``down_proj`` [4, 32, 64] where a run without EP saves [4, 64, 32], and
    the square ``gate_up_proj`` [4, 64, 64] of the tiny config transposed, which loads back unnoticed). A no-op
    without EP; the slices are back on exit."""
    swapped = []
    for prefix, module in expert_modules(model):
        for name in getattr(module, SPLIT_NAMES, ()):
            swapped.append((module, name, module._parameters[name]))
            module._parameters[name] = torch.nn.Parameter(gathered[f"{prefix}.{name}"], requires_grad=False)
    try:
        yield model
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def checkpoint_keys(model: torch.nn.Module) -> dict[str, str]:
    """A checkpoint's key for each split expert weight of this rank: its name tagged with the EP rank and size
    (``...experts.gate_up_proj@ep1of2``). Why: DCP takes a plain tensor of the same name on every rank for one
    replicated tensor (and an FSDP2 shard over the replicas' mesh for the whole), so the EP ranks' different slices
    under one name would be saved as one; tagged, each slice is its own entry, written once by one of its replicas.
    A resume needs the same EP size (another one finds no entries of its tags). Empty without EP."""
    keys = {}
    for prefix, module in expert_modules(model):
        group = getattr(module, SPLIT_GROUP, None)
        if group is None:
            continue
        tag = f"@ep{torch.distributed.get_rank(group)}of{torch.distributed.get_world_size(group)}"
        keys.update({f"{prefix}.{name}": f"{prefix}.{name}{tag}" for name in getattr(module, SPLIT_NAMES, ())})
    return keys


def renamed_experts(state: dict, keys: dict[str, str]) -> dict:
    """``state`` (a checkpoint's ``{"model": ..., "optimizer": {"state": ...}}`` from DCP's ``get_state_dict``) with
    the model's and the optimizer's entries of the split experts under ``keys`` (:func:`checkpoint_keys`, or its
    inverse to read one back); the tensors are the same objects, so DCP loads into the run's own."""
    if not keys:
        return state
    optimizer = state["optimizer"]
    return {**state, "model": {keys.get(k, k): v for k, v in state["model"].items()},
            "optimizer": {**optimizer, "state": {keys.get(k, k): v for k, v in optimizer["state"].items()}}}


TAG = re.compile(r"^(?P<name>.*)@ep(?P<rank>\d+)of(?P<size>\d+)$")  # a checkpoint key of :func:`checkpoint_keys`


def whole_experts(saved: dict) -> dict:
    """A checkpoint's metadata by key (DCP's ``TensorStorageMetadata``) with each split expert weight's slices
    (:func:`checkpoint_keys`) as one entry of the whole weight's shape under its own name, so a resume is checked
    against the model as built (before the split); a weight missing slices keeps dim 0 at -1 (another shape)."""
    whole, slices = {}, {}
    for key, item in saved.items():
        match = TAG.match(key)
        if match is None:
            whole[key] = item
        else:
            slices.setdefault(match["name"], []).append((int(match["size"]), item))
    for name, parts in slices.items():
        size, first = parts[0][0], parts[0][1]
        rows = first.size[0] * size if len(parts) == size else -1
        whole[name] = dataclasses.replace(first, size=torch.Size([rows, *first.size[1:]]))
    return whole


def describe_experts(split: ExpertSplit, experts: int) -> str:
    """The start-of-run line (rank 0's)."""
    return (f"expert parallelism: {experts} experts per layer split over {split.size} ranks ({experts // split.size} "
            f"each), {split.mesh.size() // split.size} replica(s) of each split, tokens dispatched all-to-all")
