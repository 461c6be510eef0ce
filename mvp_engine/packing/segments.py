"""Where the samples of a packed row lie: everything derives from ``pack_segment_ids`` (B, L), the segment index of
every token, -1 for the trailing padding. A *run* is a maximal stretch of equal ids in a row; runs are what attention
is confined to, so the padding run is its own block."""

from __future__ import annotations

from typing import Any

import torch


def validate_segment_ids(segment_ids: torch.Tensor) -> None:
    """Refuse layouts the helpers do not support: not (B, L), ids below -1, or padding before a real token."""
    if segment_ids.dim() != 2:
        raise ValueError(f"pack_segment_ids must be (B, L), got shape {tuple(segment_ids.shape)}")
    if segment_ids.numel() and int(segment_ids.min()) < -1:
        raise ValueError("pack_segment_ids must be >= -1 (-1 marks padding)")
    is_pad = segment_ids < 0
    if bool((is_pad[:, :-1] & ~is_pad[:, 1:]).any()):
        raise ValueError("pack_segment_ids: padding (-1) must form one trailing run per row")


def segment_run_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) index of the run each token is in (0 at the start of every row)."""
    change = torch.zeros_like(segment_ids, dtype=torch.long)
    change[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
    return change.cumsum(-1)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) positions restarting at 0 at every run (the padding run gets one fresh run 0, 1, 2, ...)."""
    runs = segment_run_ids(segment_ids)
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(runs)
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = runs[:, 1:] != runs[:, :-1]
    starts = torch.where(is_start, index, torch.zeros_like(index)).cummax(-1).values
    return index - starts


def row_segments(segment_ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per row, the ``(segment_id, start, end)`` of every run, padding included (id -1), in order."""
    out = []
    for row in segment_ids.tolist():
        runs: list[tuple[int, int, int]] = []
        for i, seg in enumerate(row):
            if runs and runs[-1][0] == seg:
                runs[-1] = (seg, runs[-1][1], i + 1)
            else:
                runs.append((seg, i, i + 1))
        out.append(runs)
    return out


def flash_varlen_kwargs(segment_ids: torch.Tensor) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int) over the flattened (B*L) tokens, one sequence per
    run (each row's padding run included), for transformers' flash-attention varlen path."""
    validate_segment_ids(segment_ids)
    batch, length = segment_ids.shape
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = is_start.reshape(-1).nonzero().view(-1)
    total = torch.tensor([batch * length], device=segment_ids.device)
    cu_seq_lens = torch.cat([starts, total]).to(torch.int32)
    max_length = int(cu_seq_lens.diff().max()) if cu_seq_lens.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
