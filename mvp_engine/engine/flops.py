"""FLOPs and MFU: the kit's cost model (``mvp_engine.kit.mllm.data.cost``) filled in from a model, counted per batch.

:func:`cost_profile` reads a transformers VLM, generically over recipes: the matmuls of every part from its parameter
shapes (each ``nn.Linear`` costs 2 x in x out FLOPs per row it processes, a patch-embedding convolution 2 x its
weight per patch, fused MoE experts 2 x their weight x top_k / num_experts per token (the active experts only; shared
experts are plain Linears), a MoE router's bare ``[E, hidden]`` weight 2 x its size per token, a projector's bare
weight matrix 2 x its size per media token), sorted into language model, output head, vision tower and projector by
module name; attention per (query, key) pair from the config (4 x heads x head_dim per layer, a layer's own head_dim
where the config has ``per_layer_config``: QK^T and AV), full-attention and sliding-window layers apart (``lm_pair``,
``lm_sliding_pair``, the window read from the config). What differs by family is the recipe's to say, in its
``cost_profile`` hook (``Recipe.cost_profile``), which calls :func:`cost_profile` with it: where the vision side sits
(:class:`VisionParts`: its module names) and its geometry (the ``CostProfile`` fields that turn media tokens into
patches: a merge or pooling of k x k patches, a CLS position, the fixed patch count of a stacked image or tile), and
bidirectional blocks (their field and layer types, ``CostProfile.block_field``; Gemma's image tokens). It works on a
model built on the meta device (:func:`planning_cost_profile`), so planning needs no weights.

Backward: a matmul's backward computes the gradient of its input (when anything upstream trains) and of its weight
(when the weight trains), each as many FLOPs as the forward; attention's backward is twice its forward when any
gradient flows through it. Parameters no forward reaches (the recipe's ``unreachable_parameters``) cost their
forward only.

:func:`batch_flops` counts a collated batch: useful FLOPs (real tokens, causal pairs per sample, the media) and
executed FLOPs for the attention backend in use (``cost.attention_pairs``: a dense mask computes L^2 per row), plus
the zero-weighted dummy media pass on micro-batches without media. Where a layer type's mask is more than causal (a
sliding window, bidirectional blocks), its executed pairs follow the form the backend takes (``mvp_engine.packing``'s
mask forms): a dense mask still L^2 per row; sdpa_varlen n^2 for a span with a mask of its own (it runs masked sdpa)
and n(n+1)/2 for a plain causal one; flex every 128 x 128 tile the layer's predicate reaches. Checked against torch's
``FlopCounterMode`` on every recipe's tiny model with the eager backend (``tests/test_flops.py``; Gemma's windows and
blocks in ``tests/test_flops_windowed.py``).

MFU = useful FLOPs per second per device / the device's peak: ``train.peak_tflops``, else :data:`GPU_PEAK_TFLOPS`
(dense bf16/fp16 tensor-core peaks) when training in bf16/fp16 on a GPU it names, else unknown (no MFU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from mvp_engine.kit.mllm.data import CostProfile, Rate, WorkUnits
from mvp_engine.kit.mllm.data.cost import BLOCK_MASK, FLEX_BLOCK, VARLEN, attention_pairs, chunked_tokens, useful_pairs
from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS
from mvp_engine.packing import (
    FULL,
    SLIDING,
    Predicate,
    batch_type_blocks,
    layer_predicates,
    packed_inputs,
    packed_predicate,
    segment_run_ids,
    unwrap_model,
)

from .lora import idle_modules, running_module

LINEAR_CHUNK = 64  # transformers' chunk_gated_delta_rule default
FULL_ATTENTION_TYPES = ("full_attention", "chunked_attention")  # chunked (Llama 4): counted as full

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (vendor data sheets, without sparsity), matched in this order against
# torch.cuda.get_device_name(): the first substring found wins.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4),
    ("H20", 148.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0),
    ("A6000", 154.8), ("RTX 4090", 165.2), ("A10", 125.0), ("V100", 125.0), ("MI300X", 1307.4), ("MI250X", 383.0),
)


# --- the profile ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionParts:
    """Where a model's vision side sits, by module name (each family names its own, so its recipe says them): a
    module with a qualified-name piece in ``tower`` is the vision tower's, one with a piece containing a
    ``projector`` name a projector's (inside the tower or not; each projector module a chain of its own), the rest
    the language model's. The default: a text-only model."""

    tower: tuple[str, ...] = ()
    projector: tuple[str, ...] = ()

    def part(self, name: str) -> str:
        """``projector``, ``vision`` or ``language_model`` from a module's qualified name."""
        pieces = name.split(".")
        if any(p in piece for piece in pieces for p in self.projector):
            return "projector"
        return "vision" if any(piece in self.tower for piece in pieces) else "language_model"

    def group(self, name: str) -> str:
        """The top-most projector module a module belongs to (each merger / projector is a chain of its own)."""
        pieces = name.split(".")
        for k, piece in enumerate(pieces):
            if any(p in piece for p in self.projector):
                # a ModuleList of mergers (Qwen3-VL's deepstack) holds one chain per index
                return ".".join(pieces[:k + 2 if k + 1 < len(pieces) and pieces[k + 1].isdigit() else k + 1])
        return name


def fixed_image_patches(vision) -> int:
    """Patches of one image (or tile) of a tower that takes a fixed size: ``image_size / patch_size`` each way (ints,
    or (height, width) pairs), read from its vision config."""
    (height, width), (patch_height, patch_width) = [
        size if isinstance(size, (list, tuple)) else (size, size) for size in (vision.image_size, vision.patch_size)]
    return (int(height) // int(patch_height)) * (int(width) // int(patch_width))


def _attention_width(config) -> int:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return heads * int(head_dim)


def _linear_attention_core(text) -> int:
    """Forward FLOPs per position of the chunked gated delta rule (transformers' torch reference, what packed
    linear-attention layers run), summed over the linear-attention layers: per value head and chunk of C tokens,
    the QK^T and K_beta K^T products (2 x 2 C^2 d_k), the intra-chunk read (2 C^2 d_v) and three state products
    (3 x 2 C d_k d_v); the triangular solve is not a matmul and is left out."""
    layers = sum(1 for kind in getattr(text, "layer_types", None) or () if kind == "linear_attention")
    if not layers:
        return 0
    heads = int(text.linear_num_value_heads)
    dk, dv, c = int(text.linear_key_head_dim), int(text.linear_value_head_dim), LINEAR_CHUNK
    return layers * heads * (4 * c * dk + 2 * c * dv + 6 * dk * dv)


def _attention_widths(text) -> tuple[int, int]:
    """Σ heads x head_dim over the full-attention layers and over the sliding-window layers."""
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers)
    per_layer = getattr(text, "per_layer_config", None)
    heads = int(text.num_attention_heads)
    full = sliding = 0
    for index, kind in enumerate(layer_types):
        head_dim = getattr(per_layer[index], "head_dim", None) if per_layer is not None else None
        width = heads * int(head_dim) if head_dim else _attention_width(text)
        if kind == SLIDING:
            sliding += width
        elif kind in FULL_ATTENTION_TYPES:
            full += width
    return full, sliding


@dataclass
class _Matmul:
    part: str  # language_model, head, vision, patch_embed, projector
    forward: int  # FLOPs per row it processes
    trains: bool
    reached: bool
    group: str  # the projector chain it belongs to


def _expert_counts(model: torch.nn.Module) -> set[int]:
    """The expert counts (dim 0) of the model's fused experts: 3-D parameters of modules that are no convolution."""
    return {int(p.shape[0]) for m in model.modules() if not isinstance(m, torch.nn.modules.conv._ConvNd)
            for p in m.parameters(recurse=False) if p.dim() == 3}


def _router_weight(module: torch.nn.Module, expert_counts: set[int]) -> torch.nn.Parameter | None:
    """A MoE router's bare weight ``[E, hidden]`` (no ``nn.Linear``: transformers' routers call ``F.linear`` on it),
    recognised by its rows being the experts' count; None for any other module."""
    if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
        return None
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 2 and int(p.shape[0]) in expert_counts]
    return weights[0] if len(weights) == 1 else None


def _matmuls(model: torch.nn.Module, unreachable: set[str], top_k: int, parts: VisionParts) -> list[_Matmul]:
    head = running_module(model.get_output_embeddings())
    expert_counts = _expert_counts(model) if top_k else set()
    idle = idle_modules(model)  # LoRA's modules_to_save: the originals do not run
    found: list[_Matmul] = []
    for name, module in model.named_modules():
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in idle):
            continue
        part = "head" if module is head else parts.part(name)
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear):
            forward = 2 * module.in_features * module.out_features
        elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            forward = 2 * weight.numel()  # per output position: a patch (kernel = stride), or a token (conv1d)
            part = "patch_embed" if part == "vision" else part
        elif part == "projector" and not isinstance(module, torch.nn.Embedding) and any(
                p.dim() == 2 for p in module.parameters(recurse=False)):
            weight = next(p for p in module.parameters(recurse=False) if p.dim() == 2)  # a bare matmul weight
            forward = 2 * weight.numel()
        elif part == "language_model" and (router := _router_weight(module, expert_counts)) is not None:
            forward, weight = 2 * router.numel(), router  # one score per expert per token
        else:
            experts = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            if not experts or part != "language_model":
                continue
            # each token runs top_k of the E experts stacked on dim 0 (shared experts are plain Linears)
            share = top_k / experts[0].shape[0] if top_k else 1.0
            forward, weight = round(2 * sum(p.numel() for p in experts) * share), experts[0]
        params = [f"{name}.{n}" if name else n for n, _ in module.named_parameters(recurse=False)]
        found.append(_Matmul(part, forward, bool(weight.requires_grad),
                             not all(p in unreachable for p in params), parts.group(name)))
    return found


RATE_OF_PART = {"language_model": "lm_token", "head": "lm_head_token", "projector": "projector_token",
                "vision": "vision_position", "patch_embed": "vision_patch"}


def cost_profile(model: torch.nn.Module, unreachable: Iterable[str] = (), parts: VisionParts = VisionParts(),
                 **geometry: int) -> CostProfile:
    """The cost profile of ``model`` as it will train (its ``requires_grad`` flags; ``unreachable``: parameters no
    forward reaches, which cost no backward), its vision side where ``parts`` says, ``geometry`` the
    ``CostProfile`` fields its recipe reads from the config (``patches_per_media_token``,
    ``extra_positions_per_item``, ``item_patches``, ``tile_tokens``). Works on a meta-device model."""
    model = unwrap_model(model)
    config = model.config
    text = config.get_text_config()
    vision = getattr(config, "vision_config", None)
    if vision is not None and not parts.tower:
        raise ValueError(f"{type(model).__name__} has a vision tower: its recipe's cost_profile hook says where it "
                         "sits (flops.VisionParts) and how its patches become media tokens")
    unreachable = set(unreachable)
    top_k = int(getattr(text, "num_experts_per_tok", None) or 0)  # transformers' name in every MoE config
    matmuls = _matmuls(model, unreachable, top_k, parts)
    head = model.get_output_embeddings()
    head_params = {id(p) for p in head.parameters()} if head is not None else set()

    def trains(*names: str) -> bool:
        return any(p.requires_grad for n, p in model.named_parameters()
                   if id(p) not in head_params and n not in unreachable
                   and parts.part(n) in names)

    vision_trains, projector_trains = trains("vision"), trains("projector")
    lm_grad = trains("language_model") or vision_trains or projector_trains  # a gradient flows through the LM

    rates = dict.fromkeys(RATE_OF_PART.values(), Rate())
    chain_trains: dict[str, bool] = {}
    for m in matmuls:
        if m.part == "patch_embed":  # its input is pixels: no input gradient
            grad_input = False
        elif m.part == "vision":
            grad_input = vision_trains
        elif m.part == "projector":  # the first of a chain reads the vision tower's output
            grad_input = vision_trains or chain_trains.get(m.group, False)
            chain_trains[m.group] = chain_trains.get(m.group, False) or m.trains
        else:
            grad_input = lm_grad
        backward = m.forward * (int(m.trains) + int(grad_input)) if m.reached else 0
        key = RATE_OF_PART[m.part]
        rates[key] = rates[key] + Rate(m.forward, backward)

    full, sliding = (4 * width for width in _attention_widths(text))
    profile = {**rates, "lm_pair": Rate(full, 2 * full if lm_grad else 0),
               "lm_sliding_pair": Rate(sliding, 2 * sliding if lm_grad else 0),
               "sliding_window": int(text.sliding_window) if sliding else 0}
    core = _linear_attention_core(text)
    if core:
        profile["lm_linear_token"] = Rate(core, 2 * core if lm_grad else 0)
        profile["linear_chunk"] = LINEAR_CHUNK
    if vision is not None:
        heads = getattr(vision, "num_attention_heads", None) or getattr(vision, "num_heads", None)
        head_dim = getattr(vision, "head_dim", None)  # where set, heads x head_dim need not be the hidden size
        width = int(heads) * int(head_dim) if heads and head_dim else int(getattr(vision, "embed_dim", None)
                                                                          or vision.hidden_size)
        blocks = [(name, m) for name, m in model.named_modules()
                  if parts.part(name) == "vision" and type(m).__name__.endswith("Attention")]
        reached = [name for name, m in blocks
                   if any(f"{name}.{n}" not in unreachable for n, _ in m.named_parameters())]
        profile["vision_pair"] = Rate(4 * width * len(blocks), 8 * width * len(reached) if vision_trains else 0)
    return CostProfile(**profile, **geometry)


def recipe_cost_profile(recipe, model: torch.nn.Module) -> CostProfile:
    """The recipe's own ``cost_profile`` hook when it has one, else :func:`cost_profile`."""
    unreachable = recipe.unreachable_parameters(unwrap_model(model))
    hook = getattr(recipe, "cost_profile", None)
    return hook(model, unreachable) if hook is not None else cost_profile(model, unreachable)


def planning_cost_profile(recipe, model_cfg) -> CostProfile:
    """The profile ``Trainer`` uses, without weights: the run's model as ``run_model.prepare_model`` prepares it
    for planning (on the meta device, its config only for a pretrained folder, with the run's adapters and
    freezing)."""
    from .config import model_spec
    from .run_model import prepare_model

    model, _ = prepare_model(recipe, model_cfg, model_spec(model_cfg), "eager", "plan")
    return recipe_cost_profile(recipe, model)


# --- counting a batch ---------------------------------------------------------------------------------------------


def _media_units(profile: CostProfile, media: Mapping, padded: bool = True) -> WorkUnits:
    """Vision work of the media fields of a batch (or of a recipe's dummy media kwargs); ``padded=False``: of the
    real patches only, where images come padded to one patch count (their padding positions -1)."""
    tokens = squares = items = 0
    ppt = profile.patches_per_media_token
    for kind in (IMAGES, VIDEOS):
        grid = media.get(kind.grid_key)
        if grid is not None and grid.numel():
            for t, h, w in grid.tolist():
                n = t * h * w // ppt
                tokens, squares, items = tokens + n, squares + n * n // max(1, t), items + 1
        elif kind is IMAGES and media.get(kind.patch_key) is not None and media[kind.patch_key].dim() == 4:
            count = int(media[kind.patch_key].shape[0])  # stacked images of one fixed size
            n = profile.item_patches // ppt
            tokens, squares, items = tokens + count * n, squares + count * n * n, items + count
        elif kind is IMAGES and media.get(kind.patch_key) is not None and media[kind.patch_key].dim() == 3:
            count, patches = media[kind.patch_key].shape[:2]  # pre-patchified images padded to one patch count
            positions = media.get(profile.patch_positions_field) if profile.patch_positions_field else None
            real = [int(patches)] * count if padded or positions is None else (positions != -1).all(-1).sum(-1).tolist()
            sizes = [n // ppt for n in real]
            tokens, squares, items = tokens + sum(sizes), squares + sum(n * n for n in sizes), items + int(count)
    return profile.media_units(tokens, squares, items)


def _row_spans(segment_ids: torch.Tensor) -> list[list[tuple[int, bool]]]:
    """Each row's runs of equal segment id, in order, as ``(length, real)`` (vectorised: rows are long)."""
    rows, width = segment_ids.shape
    if width == 0:
        return [[] for _ in range(rows)]
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    out = []
    for row in range(rows):
        starts = is_start[row].nonzero().view(-1)
        lengths = torch.diff(starts, append=torch.tensor([width], device=starts.device))
        real = segment_ids[row, starts] >= 0
        out.append(list(zip(lengths.tolist(), real.tolist())))
    return out


def _span_blocks(block_ids: torch.Tensor, segment_ids: torch.Tensor,
                 spans: list[list[tuple[int, bool]]]) -> list[list[tuple[int, bool]]]:
    """Per row and span: the pairs above the diagonal inside its blocks (``block_ids`` as ``same_block`` reads
    them; Σ n(n - 1)/2) and whether it has a block of two tokens or more (its mask is then more than causal)."""
    span_of = segment_run_ids(segment_ids)
    out = []
    for row, row_spans in enumerate(spans):
        extra, wide = [0] * len(row_spans), [False] * len(row_spans)
        ids, counts = torch.unique_consecutive(block_ids[row], return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        for block, n, start in zip(ids.tolist(), counts.tolist(), starts.tolist()):
            if block >= 0:
                span = int(span_of[row, start])
                extra[span] += n * (n - 1) // 2
                wide[span] = wide[span] or n > 1
        out.append(list(zip(extra, wide)))
    return out


def _layer_predicates(profile: CostProfile, block_ids: torch.Tensor | None) -> dict[str, Predicate]:
    """The masks the profile's layer types compute, as the packed inputs build them (``packing.layer_predicates``
    over the profile's window and block layer types)."""
    layer_types = [FULL, SLIDING] if profile.sliding_window else [FULL]
    with_blocks = [t for t, on in ((FULL, profile.full_blocks), (SLIDING, profile.sliding_blocks)) if on]
    config = SimpleNamespace(layer_types=layer_types, sliding_window=profile.sliding_window)
    return layer_predicates(config, block_ids, with_blocks)


def _flex_tiles(segment_ids: torch.Tensor, predicate: Predicate) -> int:
    """128 x 128 tiles the BlockMask of ``predicate`` over these rows keeps (partial or full): what flex computes."""
    length = segment_ids.shape[1]
    starts = torch.arange(-(-length // FLEX_BLOCK), device=segment_ids.device) * FLEX_BLOCK
    ends = (starts + FLEX_BLOCK).clamp(max=length) - 1
    any_, _ = packed_predicate(segment_ids, predicate).tiles(starts, ends)
    return int(any_.expand(segment_ids.shape[0], len(starts), len(starts)).sum())


def _executed_pairs(profile: CostProfile, kind: str, segment_ids: torch.Tensor, spans, blocks,
                    block_ids: torch.Tensor | None) -> tuple[int, int]:
    """(full-layer, sliding-layer) pairs the backend kind computes for masks beyond causal (module docstring)."""
    rows, width = segment_ids.shape
    window = profile.sliding_window
    if kind == VARLEN:
        def pairs(masked) -> int:
            return sum(n * n if masked(n, wide) else n * (n + 1) // 2
                       for row, row_blocks in zip(spans, blocks) for (n, _), (_, wide) in zip(row, row_blocks))
        full = pairs(lambda n, wide: profile.full_blocks and wide)
        sliding = pairs(lambda n, wide: (profile.sliding_blocks and wide) or n > window) if window else 0
        return full, sliding
    if kind == BLOCK_MASK:
        predicates = _layer_predicates(profile, block_ids)
        return tuple(_flex_tiles(segment_ids, predicates[k]) * FLEX_BLOCK * FLEX_BLOCK if k in predicates else 0
                     for k in (FULL, SLIDING))
    return rows * width * width, rows * width * width if window else 0


@dataclass
class BatchFlops:
    useful: int
    executed: int
    useful_units: WorkUnits
    executed_units: WorkUnits


def batch_flops(profile: CostProfile, batch: Mapping, attention: str, dummy_media: Mapping | None = None,
                packed: bool = True, dummy_passes: int | None = None) -> BatchFlops:
    """Useful and executed forward + backward FLOPs of one collated micro-batch on ``attention`` (``packed=False``:
    the padded baseline, whose linear-attention layers run over whole rows), with ``dummy_passes`` passes of
    ``dummy_media`` executed (None: one when the micro-batch has no media)."""
    segment_ids = batch["pack_segment_ids"]
    rows, width = segment_ids.shape
    spans = _row_spans(segment_ids)
    media, useful_media = _media_units(profile, batch), _media_units(profile, batch, padded=False)
    effective = int((segment_ids >= 0).sum())
    block_ids = batch_type_blocks(batch, profile.block_field, profile.block_values) if profile.has_blocks else None
    blocks = (_span_blocks(block_ids, segment_ids, spans) if block_ids is not None
              else [[(0, False)] * len(row) for row in spans])
    real = [(n, extra) for row, row_blocks in zip(spans, blocks) for (n, is_real), (extra, _) in zip(row, row_blocks)
            if is_real]
    full, sliding = useful_pairs(profile, [n for n, _ in real], sum(extra for _, extra in real))
    useful = useful_media + WorkUnits(lm_tokens=effective, lm_linear_tokens=effective, lm_pairs=full,
                                      lm_sliding_pairs=sliding)
    chunked = chunked_tokens(spans if packed else [[(width, True)]] * rows, profile.linear_chunk)
    kind = packed_inputs(attention)
    if profile.sliding_window or profile.has_blocks:
        full, sliding = _executed_pairs(profile, kind, segment_ids, spans, blocks, block_ids)
    else:
        full, sliding = attention_pairs(kind, spans, width), 0
    executed = media + WorkUnits(lm_tokens=rows * width, lm_pairs=full, lm_sliding_pairs=sliding,
                                 lm_linear_tokens=chunked)
    if dummy_passes is None:
        dummy_passes = 0 if int(batch["media_tokens"].sum()) else 1
    for _ in range(dummy_passes if dummy_media is not None else 0):
        executed = executed + _media_units(profile, dummy_media)
    return BatchFlops(profile.flops(useful), profile.flops(executed), useful, executed)


# --- peaks ---------------------------------------------------------------------------------------------------------


def device_peak_tflops(configured: float | None, mixed_precision: str,
                       device: torch.device) -> tuple[float | None, str]:
    """The peak MFU divides by, and where it came from: ``train.peak_tflops``, the table, or none."""
    if configured:
        return float(configured), "train.peak_tflops"
    if device.type != "cuda" or mixed_precision not in ("bf16", "fp16"):
        return None, f"unknown for {device.type} / mixed_precision={mixed_precision} (set train.peak_tflops)"
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_TFLOPS:
        if key in name:
            return peak, f"table: {name} dense {mixed_precision}"
    return None, f"{name} is not in the table (set train.peak_tflops)"
