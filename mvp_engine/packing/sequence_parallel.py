"""Context parallelism's model-free core: which 1/N of every packed row this rank holds, and the all-to-all that
moves a tensor between "my tokens, every head" and "every token, my heads" (Ulysses).

A packed row of L tokens (padded by the collator to a multiple of N) is cut into N contiguous chunks; CP rank r
holds tokens ``[r L/N, (r+1) L/N)`` of every row of the micro-batch. Everything per token (embeddings, MLPs, norms,
the loss) runs on the chunk; everything that mixes tokens (attention, a linear-attention layer's conv and state)
runs per head on the whole row after an all-to-all, with the whole row's masks and boundaries, and comes back.

The attention functions and linear-attention wrappers registered with transformers read the shard from here
(:func:`sequence_shard`), so no model code is copied and nothing rides on the model's kwargs (which some forwards
hand to their vision tower). It is set only while a sequence-parallel forward runs (:func:`sequence_sharded`,
entered by the engine around one micro-batch's forward, and again around a recomputed layer's replay in backward:
:func:`replay_sequence_shard`), never for the process: a shard left behind by one model would silently split the
next model's forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_to_all_single_autograd

from mvp_engine.kit.mllm.data.sample import TOKEN_FIELD_PADS


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its CP group: ``rank`` of ``size``, over ``group``."""

    group: ProcessGroup
    rank: int
    size: int

    def span(self, length: int) -> tuple[int, int]:
        """The columns ``[start, end)`` of a row of ``length`` tokens this rank holds."""
        if length % self.size:
            raise ValueError(f"context parallelism: a row of {length} tokens does not split into "
                             f"{self.size} equal chunks (the collator pads rows to a multiple of the CP size)")
        chunk = length // self.size
        return self.rank * chunk, (self.rank + 1) * chunk

    def local(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's chunk of ``tensor`` along its token dimension ``dim``."""
        start, end = self.span(tensor.shape[dim])
        return tensor.narrow(dim, start, end - start)


_ACTIVE: ContextVar[SequenceShard | None] = ContextVar("sequence_shard", default=None)


@contextmanager
def sequence_sharded(shard: SequenceShard | None) -> Iterator[None]:
    """Inside, :func:`sequence_shard` is ``shard`` (None: the sequence is not split); the previous value is back on
    leaving, so nothing outlives the forward it was entered for."""
    token = _ACTIVE.set(shard)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def sequence_shard() -> SequenceShard | None:
    """The CP group of the sequence-parallel forward running here, None outside one."""
    return _ACTIVE.get()


def replay_sequence_shard() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant): a checkpointed layer's recompute runs in
    backward, after its forward's :func:`sequence_sharded` was left (and on CUDA in autograd's own thread), so the
    replay re-enters the shard the forward saw and the recomputed all-to-alls are the forward's."""
    return nullcontext(), sequence_sharded(sequence_shard())


def all_to_all(tensor: torch.Tensor, scatter_dim: int, gather_dim: int, shard: SequenceShard) -> torch.Tensor:
    """Cut ``tensor`` into ``shard.size`` equal chunks along ``scatter_dim``, send chunk j to CP rank j, and join
    the chunks received along ``gather_dim`` in rank order; differentiable (the backward is the reverse exchange).

    tokens -> heads: ``scatter_dim`` = heads, ``gather_dim`` = tokens; heads -> tokens the other way round."""
    if tensor.shape[scatter_dim] % shard.size:
        raise ValueError(f"context parallelism: dimension {scatter_dim} of size {tensor.shape[scatter_dim]} does not "
                         f"split over {shard.size} ranks")
    send = torch.stack(tensor.chunk(shard.size, dim=scatter_dim)).contiguous()
    received = all_to_all_single_autograd(send, None, None, shard.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def exchange_rows(rows: torch.Tensor, send_counts: list[int], receive_counts: list[int],
                  shard: SequenceShard) -> torch.Tensor:
    """Uneven all-to-all of the rows of ``rows`` (differentiable): the first ``send_counts[0]`` go to rank 0, the
    next to rank 1, ...; returns what every rank sent here, in rank order."""
    return all_to_all_single_autograd(rows.contiguous(), receive_counts, send_counts, shard.group)


def local_model_kwargs(kwargs: Mapping[str, Any], shard: SequenceShard) -> dict[str, Any]:
    """Whole-row model kwargs cut to this rank's chunk: ``input_ids``, ``position_ids`` (any rows: 1-D or M-RoPE)
    and the per-token fields (token type ids) along their token dimension. Masks, ``cu_seq_lens`` and media stay
    whole: attention runs on the whole row after the all-to-all, and the media are encoded by share
    (``sequence_media``)."""
    local = dict(kwargs)
    for key in ("input_ids", "position_ids", *TOKEN_FIELD_PADS):
        if local.get(key) is not None:
            local[key] = shard.local(local[key], dim=-1)
    return local
