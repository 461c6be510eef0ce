"""Per-segment multimodal RoPE for packed rows: a model's own ``get_rope_index`` run on each packed segment alone.

transformers 5.24's multimodal-RoPE models share one contract: the base model's ``get_rope_index(input_ids,
mm_token_type_ids, <kind>_grid_thw, ...)`` walks each row as ONE sequence, runs of placeholder tokens (each media
kind with its own code in ``mm_token_type_ids``) consuming that kind's grids in order across rows. Run on a packed
row it would continue positions across samples, so each segment's slice gets its own call with only that segment's
grids. Whatever the model does inside ``get_rope_index`` (how time advances, whether a clip's grid splits into one
frame per run, how the rotary sections interleave) stays inside it: the per-segment call is what one-by-one
computes. The recipe says which token is which media kind (the type codes) and how many grid cells one token covers.

The positions are (4, B, L): row 0 the per-segment text positions (what ``create_causal_mask`` and flash's
position-based varlen fallback read), rows 1..3 the rotary rows. Masks, guards and media order are ``inputs``.

Where: in the collator, on the CPU (:func:`rope_metadata`, a family's ``packed_metadata`` hook run in the loader's
workers through :class:`RopeIndex`, the method without the model), so the step takes them from the batch
(:func:`precomputed_positions`); a batch collated without them gets the same computed in the step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MethodType
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import MediaKind

from .batch_metadata import PACKED_POSITIONS, batch_metadata, describe_packed
from .branches import batch_branches, branch_views
from .inputs import check_media_placement, text_positions
from .segments import row_segments
from .unwrap import unwrap_model

POSITION_ROWS = 4  # the text row, then the three rotary rows


def token_type_ids(input_ids: torch.Tensor, codes: Mapping[int, int]) -> torch.Tensor:
    """The modality map ``get_rope_index`` walks: ``codes[token_id]`` where a token is a placeholder, 0 (text)
    elsewhere."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for token_id, code in codes.items():
        types[input_ids == token_id] = code
    return types


def _base_model(model):
    """The base model (owner of ``get_rope_index``) inside a ``...ForConditionalGeneration``."""
    return model.model if hasattr(model, "lm_head") else model


class RopeIndex:
    """A model's own ``get_rope_index`` without the model: its base model's class and config, which is all that
    method reads in transformers 5.24 (``self.config.vision_config`` and the class's own helper methods), so the
    collator can run it on the CPU in the loader's workers (picklable, no weights) and the step need not.

    Calling it is calling ``get_rope_index``; any other method of the class (``get_vision_position_ids``) is bound
    to this stand-in, as ``get_rope_index`` calls them on ``self``."""

    def __init__(self, model):
        inner = unwrap_model(model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # under a PEFT wrapper
        base = _base_model(inner)
        self.owner, self.config = type(base), base.config

    def __call__(self, *args, **kwargs):
        return self.owner.get_rope_index(self, *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("owner", "config"):
            raise AttributeError(name)
        member = inspect.getattr_static(self.owner, name)
        if isinstance(member, staticmethod):
            return member.__func__
        if isinstance(member, classmethod):
            return member.__get__(None, self.owner)
        return MethodType(member, self) if callable(member) else member


def _segment_grids(batch: dict[str, Any], types: torch.Tensor, kind: MediaKind, code: int,
                   merge_size: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """``(row, segment)`` -> that segment's grids of ``kind`` and its rows of the kind's per-item fields the batch
    carries (``second_per_grid_ts``: how far a clip's temporal positions step), each segment's placeholders
    checked against its grids."""
    grids = batch.get(kind.grid_key)
    tokens = [] if grids is None else (grids.prod(-1) // merge_size**2).tolist()
    owners = check_media_placement(batch, types == code, tokens, kind)
    items: dict[tuple[int, int], list[int]] = {}
    for index, owner in enumerate(owners):
        items.setdefault(owner, []).append(index)
    keys = [kind.grid_key, *(key for key in kind.item_keys if batch.get(key) is not None)]
    return {owner: {key: batch[key][indices] for key in keys} for owner, indices in items.items()}


def _pair_rope(get_rope_index, input_ids: torch.Tensor, types: torch.Tensor, branches: torch.Tensor,
               owned: dict[str, torch.Tensor | None], media: Sequence[tuple[MediaKind, int]],
               merge_size: int) -> torch.Tensor:
    """(3, n) rotary positions of one preference pair's segment: ``get_rope_index`` on each sequence it stands for
    (prefix + chosen, prefix + rejected: ``branches.branch_views``) with the items whose placeholders that sequence
    holds, so both continuations continue from the prefix exactly as each conversation alone would."""
    out = torch.zeros(POSITION_ROWS - 1, input_ids.numel(), dtype=torch.long, device=input_ids.device)
    for view in branch_views(branches):
        inside = torch.zeros(input_ids.numel(), dtype=torch.bool)
        inside[view] = True
        kept: dict[str, torch.Tensor | None] = {}
        for kind, code in media:
            grids = owned.get(kind.grid_key)
            kept[kind.grid_key] = None
            if grids is None:
                continue
            firsts = (types.cpu() == code).nonzero().view(-1)
            offsets = [0, *(grids.prod(-1) // merge_size**2).cumsum(0).tolist()[:-1]]
            chosen = [i for i, offset in enumerate(offsets) if bool(inside[firsts[offset]])]
            if chosen:
                kept.update({key: value[chosen] for key, value in owned.items()
                             if value is not None and key in (kind.grid_key, *kind.item_keys)})
        tokens = view.to(input_ids.device)
        rope, _ = get_rope_index(input_ids[tokens].unsqueeze(0), mm_token_type_ids=types[tokens].unsqueeze(0),
                                 **{key: None if value is None else value.clone() for key, value in kept.items()})
        out[:, tokens] = rope[:, 0].to(out.dtype)
    return out


def segment_rope_positions(batch: dict[str, Any], model, types: torch.Tensor,
                           media: Sequence[tuple[MediaKind, int]], merge_size: int) -> torch.Tensor:
    """(4, B, L) positions: row 0 the per-segment text positions, rows 1..3 the model's own ``get_rope_index`` run
    on each segment's slice with only that segment's grids (and per-item fields) of every ``(kind, code)`` in
    ``media`` (``types``: the batch's modality map, ``code`` marking ``kind``'s placeholders; one placeholder per
    ``merge_size**2`` grid cells). Padding and text-only segments keep the text positions in all 4 rows.
    ``model``: the model or its :class:`RopeIndex`. The segments' runs are the batch's metadata where the collator
    computed it (``batch_metadata``: then nothing here reads a device value back but ``get_rope_index`` itself)."""
    input_ids = batch["input_ids"]
    positions = text_positions(batch).unsqueeze(0).repeat(POSITION_ROWS, 1, 1)
    grids = {kind: _segment_grids(batch, types, kind, code, merge_size) for kind, code in media}
    get_rope_index = model if isinstance(model, RopeIndex) else RopeIndex(model)
    metadata = batch_metadata(batch)
    runs = metadata.runs if metadata is not None else row_segments(batch["pack_segment_ids"])
    branches = batch_branches(batch)
    for row, row_runs in enumerate(runs):
        for seg, start, end in row_runs:
            owned = {kind.grid_key: None for kind, _ in media}
            for kind, _ in media:
                owned.update(grids[kind].get((row, seg), {}))
            if all(value is None for value in owned.values()):
                continue  # padding, or text-only: get_rope_index gives the same arange as row 0
            if branches is not None and bool((branches[row, start:end] != 0).any()):  # a preference pair
                positions[1:, row, start:end] = _pair_rope(get_rope_index, input_ids[row, start:end],
                                                           types[row, start:end], branches[row, start:end].cpu(),
                                                           owned, media, merge_size).to(positions.dtype)
                continue
            rope, _ = get_rope_index(
                input_ids[row : row + 1, start:end],
                mm_token_type_ids=types[row, start:end].unsqueeze(0),
                # cloned: a model may edit its grids in place (Qwen3-VL splits a clip's grid into frames)
                **{key: None if value is None else value.clone() for key, value in owned.items()},
            )
            positions[1:, row, start:end] = rope[:, 0].to(positions.dtype)
    return positions


def precomputed_positions(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The positions the collator computed for ``batch`` as the model takes them (None: compute them now)."""
    return batch.get(PACKED_POSITIONS)


def rope_metadata(batch: Mapping[str, Any], positions: Callable[[Mapping[str, Any]], torch.Tensor]) -> dict[str, Any]:
    """The collator's metadata of a packed batch for a multimodal-RoPE model: the layout (``describe_packed``) and
    ``positions`` of the batch (e.g. :func:`segment_rope_positions` over a :class:`RopeIndex`) computed with it."""
    metadata = describe_packed(batch)
    return {**metadata, PACKED_POSITIONS: positions({**batch, **metadata})}
