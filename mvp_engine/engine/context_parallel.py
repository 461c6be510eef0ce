"""``train.context_parallel_size``: a run's DP x CP layout and the sequence-parallel forward of one micro-batch.

The world is a (DP, CP) device mesh, CP innermost (ranks ``d*N .. d*N + N-1`` share data-parallel rank d's rows,
as torchtitan lays it out). The data is sharded over DP (every CP rank of a group loads the same packs); each CP
rank holds 1/N of every row's tokens (``mvp_engine.packing.sequence_parallel``), attention and linear attention
run per head on the whole row (``ulysses``), the vision work is split by share (``sequence_media``). DDP or FSDP2
runs over the whole world: a parameter's gradient is the sum over CP ranks (each holds part of the tokens) and the
mean over all ranks with the loss scaled by the world size, as without CP (``train_step``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from mvp_engine.kit.mllm.data.media import MediaKind
from mvp_engine.packing import SequenceShard, enable_ulysses, local_model_kwargs
from mvp_engine.packing.sequence_media import encode_media_shares

from .config import ConfigError
from .participation import forward_with_media_pass


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates: ``rank`` of ``world_size``, in CP groups of ``cp_size`` (``shard``: its group,
    None without context parallelism)."""

    world_size: int
    rank: int
    cp_size: int = 1
    shard: SequenceShard | None = None

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


def build_layout(accelerator, cp_size: int, packed: bool) -> ParallelLayout:
    """The run's layout; a CP size that cannot work stops with one line naming ``train.context_parallel_size``."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if cp_size == 1:
        return ParallelLayout(world, rank)
    key = f"train.context_parallel_size={cp_size}"
    if world % cp_size:
        raise ConfigError(f"{key} does not divide the {world} processes (world = data-parallel x context-parallel)")
    if not packed:
        raise ConfigError(f"{key} splits packed rows: add +packing=greedy (or bfd)")
    mesh = init_device_mesh(accelerator.device.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return ParallelLayout(world, rank, cp_size, SequenceShard(mesh["cp"].get_group(), mesh.get_local_rank("cp"),
                                                              cp_size))


def row_multiple(pad_to_multiple_of: int | None, cp_size: int) -> int | None:
    """What the collator pads rows to a multiple of: ``train.pad_to_multiple_of`` and, under CP, the CP size (the
    padding is the row's own inactive segment, as always)."""
    if cp_size == 1:
        return pad_to_multiple_of
    return math.lcm(pad_to_multiple_of or 1, cp_size)


def make_sequence_parallel(model, layout: ParallelLayout):
    """Point the model's attention at Ulysses over the layout's CP group (no-op without CP). A head count that
    does not split is one line naming the numbers."""
    if layout.shard is None:
        return model
    try:
        return enable_ulysses(model, layout.shard)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def media_keys(kinds: tuple[MediaKind, ...]) -> tuple[str, ...]:
    return tuple(key for kind in kinds for key in kind.keys)


def sequence_parallel_forward(model, kwargs: Mapping[str, Any], shard: SequenceShard, kinds: tuple[MediaKind, ...],
                              dummy_media: dict, passes: int):
    """One micro-batch's forward on this CP rank from the whole rows' model kwargs: its chunk of the tokens and
    positions, the whole rows' masks / boundaries, its share of the media encoded and exchanged (run where the
    model's own encoder pass runs). Returns the model's outputs (logits of the chunk) and the zero loss of any
    dummy media passes (None when there was none)."""
    whole = dict(kwargs)
    media = {key: whole.pop(key) for key in media_keys(kinds) if whole.get(key) is not None}
    input_ids: torch.Tensor = whole["input_ids"]

    def encode(module):
        return encode_media_shares(module, media, input_ids, shard, kinds, dummy_media)

    return forward_with_media_pass(model, local_model_kwargs(whole, shard), dummy_media, passes, encode)
