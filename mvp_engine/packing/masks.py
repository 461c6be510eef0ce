"""Attention-mask predicates over ABSOLUTE token positions of packed rows, combined with ``&`` (and) and ``|`` (or).

Why absolute positions: transformers' own mask builder re-indexes its mask functions by per-segment positions when it
detects packing, which breaks any overlay that reads a per-token tensor (measured on Gemma's sliding layers: image
blocks lost, a future image token visible). Here a predicate reads ``q_idx`` / ``kv_idx`` as indices into the packed
row itself, so packing cannot re-index it.

A predicate is two things at once:

- a flex ``mask_mod`` ``(b, h, q_idx, kv_idx) -> bool`` (also evaluated on broadcast index tensors for the dense and
  per-span forms, see ``mask_forms.py``), and
- ``tiles(starts, ends)``: for every pair of token blocks (query block x key block, blocks given by their first and
  last index) whether *any* pair inside may attend and whether *all* do — cheap, from the blocks' end tokens, so a
  ``BlockMask`` is built without an L x L tensor. Primitives answer exactly; ``&`` is exact on *all* and may claim
  *any* for a block pair where no single (q, k) satisfies every part (then flex evaluates the mask on one extra
  partial block: never wrong, at worst a little work); ``|`` is exact on *any* and may call a full block partial.

Gemma 3's masks for one sequence, for example, are ``causal() | same_block(ids)`` (full layers) and
``sliding_window(w) & (causal() | same_block(ids))`` (sliding layers: an image token sees every later token of its
image, and no token further back than the window); the forms add ``same_segment`` to every predicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .segments import segment_run_ids

Tiles = tuple[torch.Tensor, torch.Tensor]  # (any, all), each broadcastable to (B, query blocks, key blocks)


class Predicate:
    """Base of every mask predicate; subclasses define ``__call__`` (the mask_mod) and ``tiles``."""

    def __call__(self, b, h, q_idx, kv_idx) -> torch.Tensor:
        raise NotImplementedError

    def tiles(self, starts: torch.Tensor, ends: torch.Tensor) -> Tiles:
        raise NotImplementedError

    def __and__(self, other: Predicate) -> Predicate:
        return AllOf((self, other))

    def __or__(self, other: Predicate) -> Predicate:
        return AnyOf((self, other))


@dataclass(frozen=True, eq=False)
class AllOf(Predicate):
    parts: tuple[Predicate, ...]

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for part in self.parts[1:]:
            out = out & part(b, h, q_idx, kv_idx)
        return out

    def tiles(self, starts, ends):
        tiles = [part.tiles(starts, ends) for part in self.parts]
        return _reduce(torch.logical_and, [t[0] for t in tiles]), _reduce(torch.logical_and, [t[1] for t in tiles])


@dataclass(frozen=True, eq=False)
class AnyOf(Predicate):
    parts: tuple[Predicate, ...]

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for part in self.parts[1:]:
            out = out | part(b, h, q_idx, kv_idx)
        return out

    def tiles(self, starts, ends):
        tiles = [part.tiles(starts, ends) for part in self.parts]
        return _reduce(torch.logical_or, [t[0] for t in tiles]), _reduce(torch.logical_or, [t[1] for t in tiles])


def _reduce(op, tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0]
    for tensor in tensors[1:]:
        out = op(out, tensor)
    return out


class _Causal(Predicate):
    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def tiles(self, starts, ends):
        return starts[None, None, :] <= ends[None, :, None], ends[None, None, :] <= starts[None, :, None]


@dataclass(frozen=True, eq=False)
class _Window(Predicate):
    window: int

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx > q_idx - self.window

    def tiles(self, starts, ends):
        return (ends[None, None, :] > starts[None, :, None] - self.window,
                starts[None, None, :] > ends[None, :, None] - self.window)


@dataclass(frozen=True, eq=False)
class _SameRun(Predicate):
    """Same run of ``runs`` (B, L): run indices never decrease along a row, -1 = in no run (between blocks)."""

    runs: torch.Tensor

    def __call__(self, b, h, q_idx, kv_idx):
        q_run = self.runs[b, q_idx]
        return (q_run == self.runs[b, kv_idx]) & (q_run >= 0)

    def tiles(self, starts, ends):
        # the runs present in a block of tokens form an interval, read at its ends: the first run at or after its
        # first token, the last run at or before its last token (gaps, -1, excluded)
        inside = self.runs >= 0
        big = torch.iinfo(self.runs.dtype).max
        next_run = torch.where(inside, self.runs, big).flip(-1).cummin(-1).values.flip(-1)[:, starts]
        last_run = torch.where(inside, self.runs, -1).cummax(-1).values[:, ends]
        lo_q, hi_q, lo_k, hi_k = next_run[:, :, None], last_run[:, :, None], next_run[:, None, :], last_run[:, None, :]
        any_ = (torch.maximum(lo_q, lo_k) <= torch.minimum(hi_q, hi_k)) & (lo_q <= hi_q) & (lo_k <= hi_k)
        one = inside[:, starts] & inside[:, ends] & (self.runs[:, starts] == self.runs[:, ends])
        return any_, one[:, :, None] & one[:, None, :] & (lo_q == lo_k)


def causal() -> Predicate:
    """``kv <= q``."""
    return _Causal()


def sliding_window(window: int) -> Predicate:
    """One-sided window, as transformers' ``sliding_window_overlay``: ``kv > q - window`` (with ``causal``: the
    ``window`` latest tokens, the query's own included)."""
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    return _Window(int(window))


def same_segment(segment_ids: torch.Tensor) -> Predicate:
    """Same run of ``pack_segment_ids`` (B, L): no sample sees another, and the padding run (-1) is a block of its own
    that nothing real sees."""
    return _SameRun(segment_run_ids(segment_ids))


def same_block(block_ids: torch.Tensor) -> Predicate:
    """Same bidirectional block, e.g. one image's tokens: ``block_ids`` (B, L), -1 = in no block (as transformers'
    ``block_sequence_ids``). A block is a maximal stretch of one id ≥ 0, so ids only need to differ between
    neighbouring blocks (restarting per sample is fine: the forms add ``same_segment``)."""
    if block_ids.dim() != 2:
        raise ValueError(f"block ids must be (B, L), got shape {tuple(block_ids.shape)}")
    if block_ids.numel() and int(block_ids.min()) < -1:
        raise ValueError("block ids must be >= -1 (-1 = in no block)")
    inside = block_ids >= 0
    start = inside.clone()
    start[:, 1:] &= (block_ids[:, 1:] != block_ids[:, :-1]) | ~inside[:, :-1]
    runs = start.long().cumsum(-1) - 1
    return _SameRun(torch.where(inside, runs, -1))
