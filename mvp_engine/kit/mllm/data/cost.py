"""The cost model's arithmetic: forward + backward FLOPs of packed rows, from a handful of numbers per model.

Equal token counts are not equal work: attention grows with the sum of squared segment lengths and the vision tower
with the patches of each image (its attention with their square, per image). A :class:`CostProfile` holds what one
unit of each kind of work costs a given model (forward and backward FLOPs, as integers); the engine builds it from
the model (``mvp_engine.engine.flops.cost_profile``), so this module stays model-free: it counts units in packs and
batches and multiplies.

Units of work:

* ``lm_token``: one position through the language model's matmuls (all layers), ``lm_head_token`` through the
  output projection;
* ``lm_pair``: one (query, key) pair through attention, summed over the full-attention layers; ``lm_sliding_pair``
  the same over the sliding-window layers, which need only the pairs inside their window (``sliding_window``);
  ``lm_linear_token``: one position through the recurrent core of linear-attention layers (Gated DeltaNet), which
  runs in chunks of ``linear_chunk`` tokens, each sequence padded to a whole chunk;
* ``vision_patch``: one patch through the patch embedding; ``vision_position``: one vision position (a patch, or an
  extra one such as CLIP's CLS) through the vision blocks' matmuls; ``vision_pair``: one (query, key) pair of
  vision attention, summed over its blocks;
* ``projector_token``: one language-model media token through the projector / merger.

Bidirectional blocks (Gemma: one image's tokens attend to each other, in the layer types ``full_blocks`` /
``sliding_blocks`` say) add the pairs above the diagonal inside each block, n(n-1)/2 per block of n tokens; a block
is a run of tokens whose ``block_field`` value is one of ``block_values``, and at planning one media item's tokens.

Two counts of the same batch: **useful** FLOPs (what the step needed: real tokens only, causal attention inside each
sample, n(n+1)/2 pairs per segment, min(q + 1, window) per query in a sliding layer, plus the block pairs) and
**executed** FLOPs (what the attention kernel in use did: a dense L x L mask computes every pair of every row,
padding included; see ``attention_pairs``). MFU is reported on useful FLOPs.

Per-pack costs for planning (:func:`pack_costs`) need no model and no pixel: segment lengths and the media columns of
``SampleMetas`` (``media_tokens``, ``media_sq``, ``num_media``) are enough.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

RATE_FIELDS = ("lm_token", "lm_head_token", "lm_pair", "lm_sliding_pair", "lm_linear_token", "vision_patch",
               "vision_position", "vision_pair", "projector_token")
UNIT_OF_RATE = {"lm_token": "lm_tokens", "lm_head_token": "lm_tokens", "lm_pair": "lm_pairs",
                "lm_sliding_pair": "lm_sliding_pairs",
                "lm_linear_token": "lm_linear_tokens",
                "vision_patch": "vision_patches", "vision_position": "vision_positions", "vision_pair": "vision_pairs",
                "projector_token": "media_tokens"}

# How a backend takes a packed row, which decides the pairs it computes (``attention_pairs``): a dense mask over the
# padded row, causal kernels per span (varlen: each row's padding run is a span), or a block-sparse mask (128 x 128
# tiles any allowed pair falls in). ``mvp_engine.packing.backends`` gives each backend its kind.
DENSE_MASK = "dense_mask"
VARLEN = "varlen"
BLOCK_MASK = "block_mask"
FLEX_BLOCK = 128


@dataclass(frozen=True)
class Rate:
    """FLOPs of one unit of work: forward, and backward (0 where no gradient flows)."""

    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __add__(self, other: Rate) -> Rate:
        return Rate(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, k: int) -> Rate:
        return Rate(self.forward * k, self.backward * k)


@dataclass
class WorkUnits:
    """Units of work of a pack, a batch or a step; they add up."""

    lm_tokens: int = 0
    lm_pairs: int = 0
    lm_sliding_pairs: int = 0
    lm_linear_tokens: int = 0
    vision_patches: int = 0
    vision_positions: int = 0
    vision_pairs: int = 0
    media_tokens: int = 0

    def __add__(self, other: WorkUnits) -> WorkUnits:
        return WorkUnits(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class CostProfile:
    """What each unit of work costs one model (see the module docstring), plus the vision geometry that turns
    language-model media tokens into vision positions: ``patches_per_media_token`` (Qwen-VL: ``spatial_merge_size``
    squared; LLaVA: 1), ``extra_positions_per_item`` (CLIP's CLS position under LLaVA's ``default`` feature
    strategy), ``item_patches`` (patches of one image where images are stacked at a fixed size, no grid) and
    ``tile_tokens`` (InternVL: an image is tiles of this many tokens, each tile its own tower input with its own
    extra positions; 0: an image is one input), ``patch_positions_field`` (the media field of images pre-patchified
    and padded to one patch count: each patch's position, -1 on padding; the real patches are the useful work);
    the attention pattern: ``sliding_window`` (0: no sliding layers) and the bidirectional blocks (module
    docstring)."""

    lm_token: Rate = field(default_factory=Rate)
    lm_head_token: Rate = field(default_factory=Rate)
    lm_pair: Rate = field(default_factory=Rate)
    lm_sliding_pair: Rate = field(default_factory=Rate)
    lm_linear_token: Rate = field(default_factory=Rate)
    vision_patch: Rate = field(default_factory=Rate)
    vision_position: Rate = field(default_factory=Rate)
    vision_pair: Rate = field(default_factory=Rate)
    projector_token: Rate = field(default_factory=Rate)
    patches_per_media_token: int = 1
    extra_positions_per_item: int = 0
    item_patches: int = 0
    tile_tokens: int = 0
    patch_positions_field: str = ""
    linear_chunk: int = 64
    sliding_window: int = 0
    block_field: str = ""
    block_values: tuple[int, ...] = ()
    full_blocks: bool = False
    sliding_blocks: bool = False

    @property
    def has_blocks(self) -> bool:
        return bool(self.block_field) and (self.full_blocks or self.sliding_blocks)

    # ------------------------------------------------------------------------------------------------ counting

    def media_units(self, media_tokens, media_sq, num_media) -> WorkUnits:
        """Vision work of media given as language-model tokens: their sum, the sum over attention groups of the
        group's tokens squared (``SampleMeta.media_sq``) and the item count. Exact when extra positions (CLS) only
        come with single-group items (images), as in every supported model; with ``tile_tokens`` the tower's inputs
        are the tiles, whatever the image they came from: ``media_tokens / tile_tokens`` of them."""
        ppt, extra = self.patches_per_media_token, self.extra_positions_per_item
        if self.tile_tokens:
            num_media, media_sq = media_tokens // self.tile_tokens, media_tokens * self.tile_tokens
        patches = ppt * media_tokens
        return WorkUnits(vision_patches=patches, vision_positions=patches + extra * num_media,
                         vision_pairs=ppt * ppt * media_sq + 2 * extra * ppt * media_tokens + extra * extra * num_media,
                         media_tokens=media_tokens)

    def flops(self, units: WorkUnits) -> int:
        """Forward + backward FLOPs of ``units``."""
        return sum(getattr(units, UNIT_OF_RATE[name]) * getattr(self, name).total for name in RATE_FIELDS)

    def breakdown(self, units: WorkUnits) -> dict[str, dict[str, int]]:
        """Forward and backward FLOPs of ``units`` per part of the model."""
        parts = {"language_model": ("lm_token", "lm_pair", "lm_sliding_pair", "lm_linear_token"),
                 "lm_head": ("lm_head_token",),
                 "vision": ("vision_patch", "vision_position", "vision_pair"), "projector": ("projector_token",)}
        return {part: {"forward": sum(getattr(units, UNIT_OF_RATE[n]) * getattr(self, n).forward for n in names),
                       "backward": sum(getattr(units, UNIT_OF_RATE[n]) * getattr(self, n).backward for n in names)}
                for part, names in parts.items()}

    # ----------------------------------------------------------------------------------------- serialisation

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> CostProfile:
        return cls(**{k: Rate(**v) if k in RATE_FIELDS else tuple(v) if k == "block_values" else v
                      for k, v in values.items()})


def causal_pairs(lengths) -> int:
    """(query, key) pairs causal attention inside each segment needs: n(n+1)/2 per segment of length n."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int((lengths * (lengths + 1) // 2).sum())


def windowed_pairs(lengths, window: int) -> int:
    """Pairs causal attention inside a one-sided window (``kv > q - window``) needs per segment: min(q + 1, window)
    per query; ``window=0``: no window (:func:`causal_pairs`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not window:
        return causal_pairs(lengths)
    inside = np.minimum(lengths, window)
    return int((inside * (inside + 1) // 2 + (lengths - inside) * window).sum())


def useful_pairs(profile: CostProfile, lengths, block_extra) -> tuple:
    """(full-layer pairs, sliding-layer pairs) the segments of ``lengths`` need, ``block_extra`` being the pairs
    above the diagonal inside their bidirectional blocks (Σ n(n - 1)/2; inside any window, which is one-sided)."""
    full = causal_pairs(lengths) + (block_extra if profile.full_blocks else 0)
    sliding = windowed_pairs(lengths, profile.sliding_window) + (block_extra if profile.sliding_blocks else 0)
    return full, sliding


def attention_pairs(packed_inputs: str, row_spans: list[list[tuple[int, bool]]], width: int) -> int:
    """(query, key) pairs a kernel taking ``packed_inputs`` computes for rows of ``width`` slots, each row given as
    its spans in order, ``(length, real)`` (padding runs are spans with ``real=False``).

    A dense mask (eager, sdpa) computes every pair of the padded row: ``width**2`` per row. Varlen kernels
    (sdpa_varlen, flash) run causal attention per span, padding runs included: n(n+1)/2 per span (a causal kernel
    skips the upper triangle; tile rounding is ignored). A block mask (flex_attention) computes every 128 x 128 tile
    that holds an allowed pair. Any other kind is counted like a dense mask."""
    if packed_inputs == VARLEN:
        return sum(n * (n + 1) // 2 for row in row_spans for n, _ in row)
    if packed_inputs == BLOCK_MASK:
        return sum(_flex_tiles(row) for row in row_spans) * FLEX_BLOCK * FLEX_BLOCK
    return len(row_spans) * width * width


def chunked_tokens(backend_spans: list[list[tuple[int, bool]]], chunk: int) -> int:
    """Positions a chunked linear-attention core computes: every span (padding runs included) rounded up to a whole
    chunk, as the per-sample reference does over packed rows."""
    return sum(-(-n // chunk) * chunk for row in backend_spans for n, _ in row)


def _flex_tiles(spans: list[tuple[int, bool]]) -> int:
    """128 x 128 tiles (query tile >= key tile) holding an allowed pair: a pair within one real segment."""
    tiles: set[tuple[int, int]] = set()
    start = 0
    for n, real in spans:
        if real and n:
            first, last = start // FLEX_BLOCK, (start + n - 1) // FLEX_BLOCK
            tiles.update((q, k) for q in range(first, last + 1) for k in range(first, q + 1))
        start += n
    return len(tiles)


def pack_units(lengths, media_tokens, media_sq, num_media, profile: CostProfile) -> WorkUnits:
    """Useful work of one pack given its samples' packed lengths and media columns."""
    units = profile.media_units(int(np.sum(media_tokens)), int(np.sum(media_sq)), int(np.sum(num_media)))
    units.lm_tokens = units.lm_linear_tokens = int(np.sum(lengths))
    extra = int(np.sum(media_sq) - np.sum(media_tokens)) // 2 if profile.has_blocks else 0
    units.lm_pairs, units.lm_sliding_pairs = useful_pairs(profile, lengths, extra)
    return units


def pack_costs(profile: CostProfile, offsets: np.ndarray, members: np.ndarray, lengths: np.ndarray,
               media_tokens: np.ndarray, media_sq: np.ndarray, num_media: np.ndarray) -> np.ndarray:
    """Useful forward + backward FLOPs of every pack, each as its own row (float64, one per pack), vectorised over a
    plan laid out as ``members[offsets[k]:offsets[k + 1]]``. The columns are per record (``lengths``: the packed
    lengths of the admission; the media columns of ``SampleMetas``)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    members = np.asarray(members, dtype=np.int64)

    def per_pack(values: np.ndarray) -> np.ndarray:
        sums = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum(values, out=sums[1:])
        return (sums[offsets[1:]] - sums[offsets[:-1]]).astype(np.float64)

    n = np.asarray(lengths, dtype=np.int64)[members]
    mt = np.asarray(media_tokens, dtype=np.int64)[members]
    msq = np.asarray(media_sq, dtype=np.int64)[members]
    nm = np.asarray(num_media, dtype=np.int64)[members]
    units = profile.media_units(per_pack(mt), per_pack(msq), per_pack(nm))
    units.lm_tokens = units.lm_linear_tokens = per_pack(n)
    units.lm_pairs = per_pack(n * (n + 1) // 2)
    w = profile.sliding_window
    inside = np.minimum(n, w) if w else n
    units.lm_sliding_pairs = per_pack(inside * (inside + 1) // 2 + (n - inside) * w)
    if profile.has_blocks:  # one media item's tokens are one block: Σ n(n - 1)/2 = (media_sq - media_tokens) / 2
        extra = per_pack((msq - mt) // 2)
        units.lm_pairs = units.lm_pairs + extra * profile.full_blocks
        units.lm_sliding_pairs = units.lm_sliding_pairs + extra * profile.sliding_blocks
    return np.asarray(sum(getattr(units, UNIT_OF_RATE[name]) * float(getattr(profile, name).total)
                          for name in RATE_FIELDS), dtype=np.float64)
