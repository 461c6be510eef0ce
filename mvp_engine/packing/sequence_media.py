"""The vision work of a sequence-parallel micro-batch, split across its CP group instead of replicated.

Every CP rank holds the whole micro-batch but only 1/N of each row's tokens. Each rank encodes a contiguous share
of the micro-batch's media items (about 1/N of their patches) with the model's own ``get_image_features`` /
``get_video_features``; the features then travel by one uneven all-to-all so that each rank receives exactly the
features its local placeholder tokens take, in the order the model fills them (row-major over the local chunk).
They reach the model as ``mm_encoder_outputs`` (transformers 5.24's precomputed-encoder input), so the model's
own forward checks the counts, scatters them into its local embeddings and, for Qwen3-VL, builds
``visual_pos_masks`` / ``deepstack_visual_embeds`` from the same local features: no model code is copied.

Items are encoded whole (an image's or a clip's patches attend to each other in the tower), so a row whose cut
falls inside an image's placeholder run is exact: the features are cut, not the pixels. A rank whose share is
empty encodes the recipe's dummy input zero-weighted, so every rank runs the tower once per kind present (the same
FSDP2 gathers) and every media parameter takes part in every backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mvp_engine.kit.mllm.data.media import IMAGES, MediaKind

from .collective_device import collective_device
from .sequence_parallel import SequenceShard, exchange_rows
from .unwrap import unwrap_model


def item_patches(media: Mapping[str, Any], kind: MediaKind) -> list[int]:
    """Patch rows of each item of ``kind``: a grid's product (flattened patches), its count (stacked tiles) or one
    row each (stacked images)."""
    grid = media.get(kind.grid_key)
    if grid is not None:
        return [int(n) for n in grid.prod(dim=-1).tolist()]
    if kind.count_key and media.get(kind.count_key) is not None:
        return [int(n) for n in media[kind.count_key].tolist()]
    return [1] * int(media[kind.patch_key].shape[0])


def shares(patches: list[int], size: int) -> list[tuple[int, int]]:
    """Contiguous item ranges, one per rank, each about 1/``size`` of the patches (items are never cut)."""
    total = sum(patches)
    cuts, running, item = [0], 0, 0
    for rank in range(1, size):
        target = total * rank / size
        while item < len(patches) and running + patches[item] / 2 <= target:
            running += patches[item]
            item += 1
        cuts.append(item)
    cuts.append(len(patches))
    return list(zip(cuts[:-1], cuts[1:]))


def _placeholder_id(model, kind: MediaKind) -> int:
    config = unwrap_model(model).config
    names = ("image_token_id", "image_token_index") if kind.name == IMAGES.name else ("video_token_id",)
    for name in names:
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    raise ValueError(f"context parallelism: the model config has none of {list(names)} (its {kind.name} "
                     "placeholder token)")


def _features(outputs) -> list[torch.Tensor]:
    """The encoder output the language model consumes, flattened to (tokens, width) tensors: the pooled features,
    then each DeepStack layer's (Qwen3-VL)."""
    parts = [torch.cat(list(outputs.pooler_output), dim=0)]
    for layer in getattr(outputs, "deepstack_features", None) or ():
        parts.append(torch.cat(list(layer), dim=0))
    return parts


def _encode_share(model, media: Mapping[str, Any], kind: MediaKind, share: tuple[int, int], dummy: Mapping):
    """The encoder output of this rank's items, and its zero-weighted loss (the dummy input when the share is
    empty, else 0)."""
    inner = unwrap_model(model)
    start, end = share
    if start == end:
        device = next(inner.parameters()).device
        outputs = inner.get_image_features(**{k: v.to(device) for k, v in dummy.items()}, return_dict=True)
        parts = _features(outputs)
        zero = sum(p.float().sum() for p in parts) * 0.0
        return outputs, [p[:0] for p in parts], zero
    patches = item_patches(media, kind)
    first, last = sum(patches[:start]), sum(patches[:end])
    inputs = {kind.patch_key: media[kind.patch_key][first:last]}
    for key in (kind.grid_key, *kind.item_keys):  # one row per item (the count key is the kit's, not the model's)
        if media.get(key) is not None:
            inputs[key] = media[key][start:end]
    encode = inner.get_image_features if kind.name == IMAGES.name else inner.get_video_features
    outputs = encode(**inputs, return_dict=True)
    return outputs, _features(outputs), None


def encode_media_shares(model, media: Mapping[str, Any], input_ids: torch.Tensor, shard: SequenceShard,
                        kinds: tuple[MediaKind, ...], dummy: Mapping) -> tuple[dict[str, Any], torch.Tensor | None]:
    """``mm_encoder_outputs`` for this rank's chunk of ``input_ids`` (the whole rows), with each kind's items
    encoded by share, and the zero-weighted loss of any dummy pass (None when there was none)."""
    encoder_outputs: dict[str, Any] = {}
    zero = None
    for kind in kinds:
        pixels = media.get(kind.patch_key)
        if pixels is None or not pixels.numel():
            continue
        share = shares(item_patches(media, kind), shard.size)[shard.rank]
        outputs, parts, dummy_loss = _encode_share(model, media, kind, share, dummy)
        if dummy_loss is not None:
            zero = dummy_loss if zero is None else zero + dummy_loss
        local_parts = _exchange(parts, input_ids == _placeholder_id(model, kind), shard, kind)
        # in the form the model's forward reads: per-item tuples (Qwen, LLaVA) or one tensor (Gemma 3)
        tensor = isinstance(outputs.pooler_output, torch.Tensor)
        outputs.pooler_output = local_parts[0] if tensor else (local_parts[0],)
        if getattr(outputs, "deepstack_features", None) is not None:
            outputs.deepstack_features = [(part,) for part in local_parts[1:]]
        encoder_outputs[kind.name] = outputs
    return encoder_outputs, zero


def _exchange(parts: list[torch.Tensor], placeholders: torch.Tensor, shard: SequenceShard,
              kind: MediaKind) -> list[torch.Tensor]:
    """Send every rank the feature rows its chunk's placeholders take. Feature k of the micro-batch (ranks' shares
    in order) fills its k-th placeholder, row-major over the whole rows."""
    widths = [p.shape[-1] for p in parts]
    rows = torch.cat(parts, dim=-1)
    device = collective_device(shard.group)  # NCCL refuses the CPU tensors these would be by default
    counts = [torch.zeros((), dtype=torch.long, device=device) for _ in range(shard.size)]
    torch.distributed.all_gather(counts, torch.tensor(rows.shape[0], device=device), group=shard.group)
    counts = torch.stack(counts).tolist()
    if sum(counts) != int(placeholders.sum()):
        raise ValueError(f"context parallelism: the micro-batch's {kind.name}s encode to {sum(counts)} features "
                         f"but its rows hold {int(placeholders.sum())} {kind.name} placeholder tokens")
    order = placeholders.reshape(-1).long().cumsum(0).reshape(placeholders.shape) - 1
    wanted = []  # the global feature indices each rank's chunk takes, in fill order
    for rank in range(shard.size):
        start, end = SequenceShard(shard.group, rank, shard.size).span(placeholders.shape[-1])
        wanted.append(order[:, start:end][placeholders[:, start:end]])
    offsets = [sum(counts[:r]) for r in range(shard.size + 1)]
    mine = slice(offsets[shard.rank], offsets[shard.rank + 1])
    send = [w[(w >= mine.start) & (w < mine.stop)] - mine.start for w in wanted]
    own = wanted[shard.rank]
    receive = [int(((own >= offsets[r]) & (own < offsets[r + 1])).sum()) for r in range(shard.size)]
    outgoing = rows.index_select(0, torch.cat(send).to(rows.device))
    local = exchange_rows(outgoing, [len(s) for s in send], receive, shard)
    return list(local.split(widths, dim=-1))
