"""The numbers of a planned epoch: how it packs, pads and costs, and the steps it takes, from metadata alone.

Why in the engine: ``tools/pack_report.py``, ``tools/estimate_steps.py`` and ``tools/validate_recipe.py`` report
these numbers, and they must be the run's (the same dataset, the same collated widths, the same step arithmetic),
so they are computed once here and the tools only print them.
"""

from __future__ import annotations

import copy

from mvp_engine.kit.mllm.data import MLLMCollator, micro_batches_per_rank

from .config import TrainSpec

WIDTH_RULE = "longest pack of each micro-batch, rounded up to train.pad_to_multiple_of (as MLLMCollator pads)"


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def rank_rows(dataset, rank: int, epoch: int) -> list[list[int]]:
    """``rank``'s packs through the dataset's own ``rank_packs`` (a shallow copy shares the cached metadata)."""
    view = dataset if rank == dataset.rank else copy.copy(dataset)
    view.rank = rank
    return list(view.rank_packs(epoch))


def micro_batches(rows: list[list[int]], micro_batch_size: int, drop_last: bool) -> list[list[list[int]]]:
    """Consecutive groups of ``micro_batch_size`` rows; a short last group survives unless ``drop_last``."""
    groups = [rows[k:k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
    if drop_last and groups and len(groups[-1]) < micro_batch_size:
        groups.pop()
    return groups


def batch_accounting(dataset, epoch: int, train: TrainSpec) -> dict:
    """Padding and attention work of every micro-batch on every rank, as ``TokenAccounting.from_batch`` counts."""
    lengths = dataset.plan(epoch).lengths.tolist()
    collator = MLLMCollator(pad_token_id=0, pad_to_multiple_of=train.pad_to_multiple_of)
    totals = dict.fromkeys(("micro_batches", "rows", "all_padding_rows", "slots", "effective_tokens",
                            "attention_work", "dense_attention_work"), 0)
    for rank in range(dataset.world_size):
        for group in micro_batches(rank_rows(dataset, rank, epoch), train.micro_batch_size, train.drop_last):
            segments = [[lengths[i] for i in pack] for pack in group]
            width = collator.padded_length(max(sum(row) for row in segments))
            totals["micro_batches"] += 1
            totals["rows"] += len(group)
            totals["all_padding_rows"] += sum(1 for pack in group if not pack)
            totals["slots"] += len(group) * width
            totals["effective_tokens"] += sum(sum(row) for row in segments)
            totals["attention_work"] += sum(n * n for row in segments for n in row)
            totals["dense_attention_work"] += len(group) * width * width
    num_packs = len(dataset.plan(epoch).packs)
    return {
        "width_rule": WIDTH_RULE,
        "world_size": dataset.world_size,
        "micro_batch_size": train.micro_batch_size,
        "drop_last": train.drop_last,
        "pad_to_multiple_of": train.pad_to_multiple_of,
        "micro_batches_per_rank": micro_batches_per_rank(num_packs, train.micro_batch_size, dataset.world_size,
                                                         train.drop_last),
        **totals,
        "padding_ratio": 1.0 - totals["effective_tokens"] / totals["slots"] if totals["slots"] else 0.0,
        "attention_work_ratio": _ratio(totals["attention_work"], totals["dense_attention_work"]),
    }
