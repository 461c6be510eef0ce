"""A run's parallel layout and plan: one device mesh with named dims, one ``parallelize`` in a fixed order, and the
sequence-parallel forward of one micro-batch (``train.context_parallel_size``, ``train.sharding``).

The world is a (DP, CP) device mesh, CP innermost (ranks ``d*N .. d*N + N-1`` share data-parallel rank d's rows,
as torchtitan lays it out); it is built once, by :func:`build_layout`, and everything parallel takes it from the
layout (EP: as (edp, ep), ``expert_parallel.py``). The data is sharded over DP (every CP rank of a group
loads the same packs); each CP rank holds 1/N of every row's tokens (``mvp_engine.packing.sequence_parallel``),
attention and linear attention run per head on the whole row (``ulysses``), the vision work is split by share
(``sequence_media``). DDP or FSDP2 runs over the whole world: a parameter's gradient is the sum over CP ranks (each
holds part of the tokens) and the mean over all ranks with the loss scaled by the world size, as without CP
(``train_step``).

Why one ``parallelize``: the steps must come in one order (torchtitan's) on every path that builds a run's model,
and a family that needs its own plan (tensor or expert split) adds it in one place, ``Recipe.parallelize``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mvp_engine.kit.mllm.data.media import MediaKind
from mvp_engine.packing import SequenceShard, enable_ulysses, local_model_kwargs, sequence_sharded
from mvp_engine.packing.sequence_media import encode_media_shares

from .config import ConfigError, TrainSpec
from .expert_parallel import exclude_from_ddp, expert_parallel, shard_expert_replicas
from .participation import forward_with_media_pass
from .quantize import FSDP2_REFUSAL, quantized_layers
from .recompute import enable_activation_checkpointing
from .sharding import load_full_state_dict, shard_model

DP, CP = "dp", "cp"  # the mesh's dims, outermost first
WORLD = f"{DP}_{CP}"  # both flattened into one: every rank


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates: ``rank`` of ``world_size``, in CP groups of ``cp_size`` (``shard``: its group,
    None without context parallelism); ``mesh``: the run's (DP, CP) device mesh, None in one process and in a
    plan (which has no processes)."""

    world_size: int
    rank: int
    cp_size: int = 1
    shard: SequenceShard | None = None
    mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different sets of rows train at once."""
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def counts_rows(self) -> bool:
        """This rank counts its group's rows (tokens, samples, FLOPs): the first of each CP group, so a row split
        over N ranks is counted once, not N times."""
        return self.rank % self.cp_size == 0

    @property
    def world_mesh(self) -> DeviceMesh | None:
        """Every rank as one dim (DP x CP flattened), what FSDP2 shards over: the CP ranks of a group hold
        different tokens, so their gradients are reduced too."""
        if self.mesh is None:
            return None
        return self.mesh[DP] if self.cp_size == 1 else self.mesh[WORLD]


def check_layout(world_size: int, cp_size: int, packed: bool) -> None:
    """One line naming ``train.context_parallel_size`` when the CP size cannot work on ``world_size`` processes."""
    if cp_size == 1:
        return
    key = f"train.context_parallel_size={cp_size}"
    if world_size % cp_size:
        raise ConfigError(f"{key} does not divide the {world_size} processes (world = data-parallel x "
                          "context-parallel)")
    if not packed:
        raise ConfigError(f"{key} splits packed rows: add +packing=greedy (or bfd)")


def plan_layout(world_size: int, cp_size: int, packed: bool) -> ParallelLayout:
    """The layout rank 0 of a ``world_size``-process run would have, without processes (reports, estimates)."""
    check_layout(world_size, cp_size, packed)
    return ParallelLayout(world_size, 0, cp_size)


def group_timeout_options(timeout_s: int):
    """Process-group options carrying ``timeout_s`` for the mesh's own groups, of the world's backend. Why: a device
    mesh makes the groups of a dim that does not span the world with ``new_group``, which, given no timeout, takes
    torch's default (10 minutes on NCCL), not the world's ``train.dist_timeout_s``; the mesh reads the timeout from
    these options (NCCL takes only its own options class, gloo ignores them but for the timeout)."""
    if "nccl" in torch.distributed.get_backend():
        options = torch.distributed.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    else:
        options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return options


def build_layout(accelerator, cp_size: int, packed: bool, timeout_s: int | None = None) -> ParallelLayout:
    """The run's layout and its one device mesh (every process takes part: call it at the same point on each); no
    mesh in a process without a process group. ``timeout_s`` (``train.dist_timeout_s``): how long the groups the
    mesh makes wait, as the world group does (a dim spanning the world reuses the world's group)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    check_layout(world, cp_size, packed)
    if world == 1 and not torch.distributed.is_initialized():
        return ParallelLayout(world, rank)
    shape = (world // cp_size, cp_size)
    override = ({} if timeout_s is None else
                {name: group_timeout_options(timeout_s) for name, size in zip((DP, CP), shape) if size != world})
    mesh = init_device_mesh(accelerator.device.type, shape, mesh_dim_names=(DP, CP), backend_override=override or None)
    if cp_size == 1:
        return ParallelLayout(world, rank, mesh=mesh)
    mesh[DP, CP]._flatten(WORLD)  # a new process group (FSDP2's): made here, on every rank alike
    return ParallelLayout(world, rank, cp_size, SequenceShard(mesh[CP].get_group(), mesh.get_local_rank(CP), cp_size),
                          mesh)


def row_multiple(pad_to_multiple_of: int | None, cp_size: int) -> int | None:
    """What the collator pads rows to a multiple of: ``train.pad_to_multiple_of`` and, under CP, the CP size (the
    padding is the row's own inactive segment, as always)."""
    if cp_size == 1:
        return pad_to_multiple_of
    return math.lcm(pad_to_multiple_of or 1, cp_size)


def make_sequence_parallel(model, layout: ParallelLayout):
    """Point the model's attention at Ulysses over the layout's CP group (no-op without CP). A head count that
    does not split is one line naming the numbers and the config key."""
    if layout.shard is None:
        return model
    try:
        return enable_ulysses(model, layout.shard)
    except ValueError as err:
        raise ConfigError(f"train.context_parallel_size={layout.cp_size}: {err}") from None


def parallelize(model, layout: ParallelLayout, train: TrainSpec, recipe=None, accelerator=None,
                weights_from_rank0: bool = False, frozen: torch.nn.Module | None = None):
    """``model`` as the run trains it, in one fixed order: activation checkpointing (before any wrapper: it replaces
    each layer's forward, and FSDP2's hooks must stay outside the recompute), context-parallel attention, the
    recipe's own plan (``Recipe.parallelize(model, layout, train)``, where it has one), then FSDP2 over the
    layout's mesh or accelerate's DDP when ``accelerator`` is given (without one, e.g. evaluation, no wrapper).
    ``weights_from_rank0``: the other ranks built a pretrained model without its weights; FSDP2 hands them
    rank 0's. ``frozen``: a frozen copy of ``model`` taken before this call (``dpo.reference=copy``), sharded in
    place by :func:`shard_frozen` under FSDP2; left whole otherwise (DDP has nothing to do for a model without
    gradients)."""
    if train.activation_checkpointing:
        enable_activation_checkpointing(model)
    model = make_sequence_parallel(model, layout)
    hook = getattr(recipe, "parallelize", None)
    if hook is not None:
        model = hook(model, layout, train)
    if accelerator is None:
        return model
    if train.sharding == "fsdp2" and quantized_layers(model):
        raise ConfigError(FSDP2_REFUSAL)
    split = expert_parallel(model, layout, train, weights_from_rank0)  # train.expert_parallel_size
    if train.sharding == "fsdp2":
        # torch's fully_shard, not accelerator.prepare: accelerate 1.15 ignores its FSDP2 plugin on a CPU machine
        # and wraps the model in DDP (sharding.py); the optimizer is built over the shards
        full = model.state_dict() if weights_from_rank0 and accelerator.is_main_process else {}
        if split is not None:
            shard_expert_replicas(model, split, train.mixed_precision, train.offload)
        model = shard_model(model, train.mixed_precision, layout.world_mesh, train.offload)
        if weights_from_rank0:
            load_full_state_dict(model, full, () if split is None else split.names)
        if frozen is not None:
            shard_frozen(frozen, layout, train, full if weights_from_rank0 else None)
    else:
        if split is not None:
            exclude_from_ddp(model, split)
        model = accelerator.prepare_model(model)
    if train.time_barrier and accelerator.num_processes > 1 and \
            not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError("train.time_barrier=true needs DDP (torchrun or conf/accelerate/ddp.yaml) or one "
                          f"process; this run is {accelerator.distributed_type.value}")
    return model


def shard_frozen(frozen: torch.nn.Module, layout: ParallelLayout, train: TrainSpec, full: dict | None = None) -> None:
    """``frozen`` (a frozen copy of the policy, ``dpo.reference=copy``) sharded in place with the policy's FSDP2
    plan: the same units over the same mesh, mixed precision and offload (``shard_model``), so a rank holds 1/N of
    it, as of the policy. ``full``: rank 0's state dict when the other ranks built the model without its weights (their
    copy is as empty as their policy was), broadcast into the copy's shards as into the policy's. As the policy's, the
    root unit stays gathered after its forward (the head is applied after it, ``linear_loss.HeadInputs``); the copy
    runs no backward to reshard it, so ``PreferenceObjective`` reshards it once its log-probs are taken.

    The policy's experts split over ranks (``train.expert_parallel_size``) have no counterpart here: refused in one
    line, the copy's experts would be sharded another way than the policy's."""
    if train.expert_parallel_size != 1:
        raise ConfigError(f"dpo.reference=copy with train.sharding=fsdp2 and train.expert_parallel_size="
                          f"{train.expert_parallel_size} is not supported: use dpo.reference=precomputed (or "
                          "adapters_off with LoRA)")
    shard_model(frozen, train.mixed_precision, layout.world_mesh, train.offload)
    if full is not None:
        load_full_state_dict(frozen, full)


def media_keys(kinds: tuple[MediaKind, ...]) -> tuple[str, ...]:
    return tuple(key for kind in kinds for key in kind.keys)


def sequence_parallel_forward(model, kwargs: Mapping[str, Any], shard: SequenceShard, kinds: tuple[MediaKind, ...],
                              dummy_media: dict, passes: int,
                              autocast: Callable[[], AbstractContextManager] = nullcontext):
    """One micro-batch's forward on this CP rank from the whole rows' model kwargs: its chunk of the tokens and
    positions, the whole rows' masks / boundaries, its share of the media encoded and exchanged (run where the
    model's own encoder pass runs). The shard is active for the attention functions only inside this call (and
    again in a recomputed layer's replay). Returns the model's outputs (logits of the chunk) and the zero loss of
    any dummy media passes (None when there was none). ``autocast``: the model's forward's, for the media encoding
    (``forward_with_media_pass``)."""
    whole = dict(kwargs)
    media = {key: whole.pop(key) for key in media_keys(kinds) if whole.get(key) is not None}
    input_ids: torch.Tensor = whole["input_ids"]

    def encode(module):
        return encode_media_shares(module, media, input_ids, shard, kinds, dummy_media)

    with sequence_sharded(shard):
        return forward_with_media_pass(model, local_model_kwargs(whole, shard), dummy_media, passes, encode,
                                       autocast)
