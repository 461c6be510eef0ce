"""Preference pairs in a packed row: the branch id (``pair_branch_ids``: 0 prefix, 1 chosen, 2 rejected; 0 for every
token of an ordinary sample and of padding) beside the segment id, read by the masks and the positions.

A pair is one segment: its prefix, then its two continuations (``mvp_engine.kit.mllm.data.pairs``). Within the
segment a token sees the prefix and its own branch, causally (:func:`same_branch_or_prefix`, and'ed with the
segment and causal predicates every mask form already applies); positions of the rejected continuation restart
where the chosen one began (:func:`branch_position_offsets`). Outside pairs the branch ids are all 0 and the
predicate is always true, so ordinary samples packed beside pairs are masked exactly as before.

``sdpa_varlen`` takes no mask for a pair: :func:`carry_pair_parts` tells its ``cu_seq_lens`` each pair segment's
part lengths (prefix, chosen, rejected), and the kernel runs the prefix as a causal span and merges each
continuation's attention over the prefix and over itself (``prefix_attention``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mvp_engine.kit.mllm.data.pairs import BRANCH_FIELD, CHOSEN, PREFIX, REJECTED

from .batch_metadata import host_bounds
from .masks import Predicate
from .segments import segment_run_ids

_PAIR_PARTS = "_pair_parts"  # a cu_seq_lens tensor's pair layout per run, set by carry_pair_parts


def batch_branches(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The batch's (B, L) branch ids where a segment holds more than one branch (a pair sharing its prefix), else
    None: no pair, or only pairs laid out as two segments (their masks and positions are the plain ones)."""
    branches, segment_ids = batch.get(BRANCH_FIELD), batch["pack_segment_ids"]
    if branches is None or not bool((branches != PREFIX).any()):
        return None
    if branches.shape != segment_ids.shape:
        raise ValueError(f"{BRANCH_FIELD} {tuple(branches.shape)} and pack_segment_ids "
                         f"{tuple(segment_ids.shape)} differ")
    within = (branches[:, 1:] != branches[:, :-1]) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return branches if bool(within.any()) else None


def branch_position_offsets(segment_ids: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """(B, L) what to subtract from per-segment positions: on a rejected token, its segment's chosen-token count
    (so both continuations continue from the prefix), 0 elsewhere."""
    runs = segment_run_ids(segment_ids)
    chosen = torch.zeros(runs.shape[0], int(runs.max()) + 1 if runs.numel() else 1, dtype=torch.long,
                         device=runs.device)
    chosen.scatter_add_(1, runs, (branches == CHOSEN).long())
    return torch.where(branches == REJECTED, chosen.gather(1, runs), 0)


@dataclass(frozen=True, eq=False)
class _SameBranchOrPrefix(Predicate):
    """kv is a prefix token (branch 0) or in the query's branch."""

    branches: torch.Tensor

    def __call__(self, b, h, q_idx, kv_idx):
        kv = self.branches[b, kv_idx]
        return (kv == PREFIX) | (kv == self.branches[b, q_idx])

    def tiles(self, starts, ends):
        # exact on *all* (a key block of prefix tokens only, or both blocks inside one branch), *any* claimed
        # everywhere: flex then evaluates the mask on the block pair, never wrong
        lo = torch.stack([self.branches[:, s:e + 1].amin(-1) for s, e in zip(starts.tolist(), ends.tolist())], -1)
        hi = torch.stack([self.branches[:, s:e + 1].amax(-1) for s, e in zip(starts.tolist(), ends.tolist())], -1)
        one = lo == hi
        key_prefix = (hi == PREFIX)[:, None, :]
        same = one[:, :, None] & one[:, None, :] & (lo[:, :, None] == lo[:, None, :])
        all_ = key_prefix | same
        return torch.ones_like(all_), all_


def same_branch_or_prefix(branches: torch.Tensor) -> Predicate:
    """The pair predicate over (B, L) branch ids: a continuation never sees the other (module docstring)."""
    if branches.dim() != 2:
        raise ValueError(f"{BRANCH_FIELD} must be (B, L), got shape {tuple(branches.shape)}")
    return _SameBranchOrPrefix(branches)


def branch_views(branches: torch.Tensor) -> list[torch.Tensor]:
    """Indices (into a segment's 1-D ``branches``) of the sequences a pair segment stands for: prefix + chosen and
    prefix + rejected; the whole segment when it is no pair."""
    if not bool((branches != PREFIX).any()):
        return [torch.arange(branches.numel(), device=branches.device)]
    prefix = branches == PREFIX
    return [(prefix | (branches == branch)).nonzero().view(-1) for branch in (CHOSEN, REJECTED)]


def carry_pair_parts(cu_seq_lens: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """``cu_seq_lens`` (the segment runs over the flattened (B, L) batch) told each run's pair layout, for
    ``sdpa_varlen``: ``(prefix, chosen, rejected)`` token counts for a segment holding both continuations, None for
    any other run (its attention is plain causal: an ordinary sample, padding, a duplicated-prefix conversation).
    Read back once, here; a pair segment laid out otherwise than prefix, chosen, rejected is refused in one line."""
    bounds = host_bounds(cu_seq_lens)
    width = branches.shape[-1]
    flat = branches.reshape(-1)
    if flat.numel() != bounds[-1]:
        raise ValueError(f"{BRANCH_FIELD} holds {flat.numel()} tokens, cu_seq_lens cover {bounds[-1]}")
    sizes = torch.tensor([end - start for start, end in zip(bounds[:-1], bounds[1:])], device=flat.device)
    run = torch.repeat_interleave(torch.arange(len(sizes), device=flat.device), sizes)
    known = (flat >= PREFIX) & (flat <= REJECTED)
    counts = torch.zeros(len(sizes), REJECTED + 1, dtype=torch.long, device=flat.device)
    counts.index_put_((run, flat.clamp(PREFIX, REJECTED)), known.long(), accumulate=True)
    backwards = ((flat[1:] < flat[:-1]) & (run[1:] == run[:-1])).nonzero().view(-1)
    if not bool(known.all()):
        raise ValueError(f"{BRANCH_FIELD} must be {PREFIX}, {CHOSEN} or {REJECTED}, got {flat[~known][0].item()}")
    if backwards.numel():
        row, column = divmod(int(backwards[0]) + 1, width)
        raise ValueError(f"row {row} column {column}: a pair segment must be its prefix, then its chosen, then its "
                         f"rejected continuation ({BRANCH_FIELD} goes back)")
    parts = []
    for start, (prefix, chosen, rejected) in zip(bounds, counts.tolist()):
        if chosen and rejected and not prefix:
            raise ValueError(f"row {start // width}: a pair segment without a prefix")
        parts.append((prefix, chosen, rejected) if chosen and rejected else None)
    setattr(cu_seq_lens, _PAIR_PARTS, tuple(parts))
    return cu_seq_lens


def pair_parts(cu_seq_lens: torch.Tensor | None) -> tuple[tuple[int, int, int] | None, ...] | None:
    """What :func:`carry_pair_parts` told ``cu_seq_lens`` (None: no pair layout, every run plain causal)."""
    return getattr(cu_seq_lens, _PAIR_PARTS, None)
