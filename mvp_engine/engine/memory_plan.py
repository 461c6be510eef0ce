"""Will a run fit? Bytes per rank of one training step, from a model built on the meta device (no weights) and the
run's settings: what ``tools/plan_memory.py`` prints.

Why a model rather than a table: the parameters, their dtypes and which of them train are read from the model as
the run prepares it (``run_model.prepare_model``: adapters and freezing included), and the activations from the
modules its transformer blocks are made of, so a new family needs no entry here.

What each term is, per rank:

- **parameters / gradients / optimizer state**: bytes of the parameters in their dtype (``model.dtype``; a
  quantized base weight its packed size), a gradient per trainable parameter in the parameter's dtype, AdamW's two
  moments in fp32; FSDP2 divides all three by the ranks it shards over; ``train.offload=params`` moves all three
  to the host, leaving on the device the unsharded units FSDP2 gathers (the root unit: embeddings, head,
  projector, kept gathered from its forward to its backward; and the largest block twice: one computing, one
  prefetched); ``train.offload=optimizer`` moves the optimizer state alone.
- **saved activations**: what autograd keeps from the forward for the backward, per position of each transformer
  block (:func:`block_saved_bytes`), times the positions it sees (language-model tokens of this rank's micro-batches,
  the vision tower's patches of the media among them), plus the embeddings' output; with activation checkpointing
  each block keeps only its input and one block's activations are recomputed at a time.
- **loss peak**: the full loss keeps the logits, their fp32 copy and an fp32 log-softmax (``positions x V``), and
  its backward adds an fp32 gradient; the chunked loss (``linear_loss.py``) projects ``chunk_tokens`` supervised
  positions at a time and keeps their hidden states (or, fused on a plain linear head, their gradient and the
  head's fp32 gradient).

How a block's activations are found: its norms and its MLP are run on the meta device (shapes only, no memory) with
``saved_tensors_hooks`` counting what they keep, so each family's own norm and MLP code decides (an fp32 upcast in
a norm, a gated or plain MLP); its attention is counted from its projections' widths as a fused kernel keeps it
(the projections' input, the query / key / value it attends with, its output and the output projection's input;
no ``L x L`` scores: flash and the memory-efficient kernels never keep them). ``tests/test_plan_memory.py`` checks
the activation and loss terms against bytes counted from tensors on the CPU (``recompute.SavedForBackward``)
within 10 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mvp_engine.packing import unwrap_model

from .linear_loss import plain_linear

GIB = 2**30
ADAM_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32, per trainable element
# packed bytes per weight element of a quantized base layer, its block constants included (bitsandbytes: nf4 packs
# two 4-bit codes a byte plus an fp32 absmax per 64 weights; int8 (LLM.int8) one byte plus an fp32 scale per row)
QUANTIZED_BYTES = {"nf4": 0.5 + 4 / 64, "int8": 1.0}
# module-name endings of the projection that reads an attention's or an MLP's result (it keeps its own input); the
# other projections of the same module read the module's input together and keep it once
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "proj", "down_proj", "fc2", "linear_fc2", "dense")


@dataclass(frozen=True)
class Settings:
    """The run's settings the plan reads: ``world_size`` ranks, ``sharding`` (none: DDP; fsdp2), ``cp`` context
    parallel ranks per row, ``recompute`` (activation checkpointing), ``loss_impl`` (full or chunked: liger and cce
    keep about what chunked does), ``chunk_tokens``, ``offload`` (none, params, optimizer), ``quantization`` (none,
    nf4, int8: the base's linear layers when LoRA trains), ``micro_batch`` rows of ``length`` packed tokens, of
    which ``media_share`` are media tokens and ``supervised_share`` are supervised targets, activations in
    ``act_bytes`` per element (2: bf16 autocast or FSDP2's bf16 compute)."""

    world_size: int = 8
    sharding: str = "fsdp2"
    cp: int = 1
    recompute: bool = False
    loss_impl: str = "chunked"
    chunk_tokens: int = 512
    offload: str = "none"
    quantization: str = "none"
    micro_batch: int = 1
    length: int = 32768
    media_share: float = 0.5
    supervised_share: float = 0.3
    act_bytes: int = 2


# --- activations of one block -----------------------------------------------------------------------------------


class _SavedCount(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd saves inside the block, meta tensors included (each base tensor once)."""

    def __init__(self, skip: set[int]):
        self.bytes = 0
        self._seen: set[int] = set()
        self._skip = skip

        def pack(tensor):
            base = tensor if tensor._base is None else tensor._base
            if id(base) not in self._seen and id(base) not in self._skip:
                self._seen.add(id(base))
                self.bytes += base.numel() * base.element_size()
            return tensor

        super().__init__(pack, lambda tensor: tensor)


def _meta_saved_bytes(module: torch.nn.Module, width: int, dtype: torch.dtype, positions: int = 8) -> float:
    """Bytes per position ``module`` (a norm or an MLP, called as ``module(x)``) keeps for backward, run on an input
    ``[1, positions, width]`` on the module's device (the meta device: shapes only)."""
    skip = {id(t) for t in (*module.parameters(), *module.buffers())}
    device = next(module.parameters()).device
    x = torch.zeros(1, positions, width, device=device, dtype=dtype, requires_grad=True)
    count = _SavedCount(skip)
    with count:
        module(x)
    return count.bytes / positions


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Norm")


def _width(norm: torch.nn.Module) -> int:
    weight = getattr(norm, "weight", None)
    if weight is not None:
        return int(weight.shape[-1])
    return int(getattr(norm, "normalized_shape", (getattr(norm, "dim", 0),))[-1])


def _attention_bytes(attention: torch.nn.Module, dtype: torch.dtype) -> float:
    """Bytes per position a fused attention kernel's layer keeps: the projections' shared input, the query, key and
    value it attends with, its output and the output projection's input (another layout of it), an fp32
    log-sum-exp per head, and what its query / key norms keep (run on the meta device)."""
    size = torch.empty(0, dtype=dtype).element_size()
    linears = {name.removesuffix(".base_layer").rsplit(".", 1)[-1]: m for name, m in attention.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name}  # a LoRA layer: its base layer
    outputs = [m for name, m in linears.items() if name in OUTPUT_PROJECTIONS]
    inputs = [m for name, m in linears.items() if name not in OUTPUT_PROJECTIONS]
    if not inputs or not outputs:
        raise ValueError(f"{type(attention).__name__}: no query/key/value and output projections found")
    projected = sum(m.out_features for m in inputs)  # q + k + v (a fused qkv: all three)
    query = outputs[0].in_features
    heads = max(1, query // int(getattr(attention, "head_dim", 0) or query))
    kept = size * (inputs[0].in_features + projected + 2 * query) + 4 * heads
    keys = linears["k_proj"].out_features if "k_proj" in linears else (projected - query) // 2
    for name, norm in attention.named_children():
        if _is_norm(norm):  # q_norm / k_norm: one row per head
            rows = (query if name.startswith("q") else keys) // _width(norm)
            kept += rows * _meta_saved_bytes(norm, _width(norm), dtype)
    return kept


def _children(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.nn.Module]]:
    attention = mlp = None
    norms = []
    for child in block.children():
        kind = type(child).__name__
        if kind.endswith("Attention"):
            attention = child
        elif kind.endswith("MLP") or kind.endswith("Mlp"):
            mlp = child
        elif _is_norm(child):
            norms.append(child)
    return attention, mlp, norms


def transformer_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module made of an attention, an MLP and norms (decoder layers, vision blocks), by qualified name."""
    found = []
    for name, module in model.named_modules():
        attention, mlp, norms = _children(module)
        if attention is not None and mlp is not None and norms:
            found.append((name, module))
    return found


def block_saved_bytes(block: torch.nn.Module, dtype: torch.dtype) -> float:
    """Bytes per position one transformer block keeps for its backward, computing in ``dtype``."""
    attention, mlp, norms = _children(block)
    hidden = _width(norms[0])
    return (_attention_bytes(attention, dtype) + _meta_saved_bytes(mlp, hidden, dtype)
            + sum(_meta_saved_bytes(norm, _width(norm), dtype) for norm in norms))


# --- the plan ----------------------------------------------------------------------------------------------------


@dataclass
class BlockGroup:
    """The transformer blocks of one side (language model or vision), alike: how many, their input width and
    bytes each keeps per position."""

    count: int = 0
    hidden: int = 0
    saved_per_position: float = 0.0


@dataclass
class ModelShape:
    """What the plan reads from a (meta) model: parameter elements by kind, the block groups, the vocabulary and
    the language model's width, the largest sharding unit's elements."""

    trainable: int = 0
    frozen_bytes: float = 0.0
    quantizable: int = 0  # frozen elements of linear layers inside the language model's blocks
    parameters: int = 0
    language: BlockGroup = field(default_factory=BlockGroup)
    vision: BlockGroup = field(default_factory=BlockGroup)
    vocab: int = 0
    hidden: int = 0
    largest_unit: int = 0
    root: int = 0  # elements outside the blocks (embeddings, head, projector): FSDP2's root unit
    dtype_bytes: int = 4
    per_token: float = 0.0  # outside the blocks, per language-model token: the final norm
    per_patch: float = 0.0  # outside the blocks, per vision patch: the patch embedding's input
    per_media_token: float = 0.0  # outside the blocks, per media token: the projector's linear layers
    # elements of a trained plain linear head (linear_loss.plain_linear): the chunked loss fuses it and keeps its
    # fp32 gradient from the loss's forward to its backward; 0 for another head or a frozen one
    fused_head: int = 0


def model_shape(model: torch.nn.Module, act_dtype: torch.dtype) -> ModelShape:
    """:class:`ModelShape` of ``model`` (its ``requires_grad`` flags as the run sets them), activations in
    ``act_dtype``."""
    model = unwrap_model(model)
    shape = ModelShape()
    params = list(model.parameters())
    shape.parameters = sum(p.numel() for p in params)
    shape.trainable = sum(p.numel() for p in params if p.requires_grad)
    shape.frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    shape.dtype_bytes = params[0].element_size()
    text = model.config.get_text_config()
    shape.vocab, shape.hidden = int(text.vocab_size), int(text.hidden_size)
    decoder = model.get_decoder()
    in_decoder = {id(m) for m in decoder.modules()}
    blocks = transformer_blocks(model)
    in_blocks = {id(m) for _, block in blocks for m in block.modules()}
    size = torch.empty(0, dtype=act_dtype).element_size()
    head = model.get_output_embeddings()
    if head is not None and plain_linear(head):
        shape.fused_head = sum(p.numel() for p in head.parameters() if p.requires_grad)
    for module in model.modules():
        if id(module) in in_blocks or module is head:
            continue
        if isinstance(module, torch.nn.modules.conv._ConvNd):  # a patch embedding keeps its input, per patch
            shape.per_patch += size * math.prod(module.weight.shape[1:])
        elif isinstance(module, torch.nn.Linear) and id(module) not in in_decoder:
            # a projector's layer keeps its input, and the activation between two of them keeps as much
            shape.per_media_token += 2 * size * module.in_features
    final_norm = next((m for name, m in decoder.named_children() if _is_norm(m)), None)
    if final_norm is not None:
        shape.per_token += _meta_saved_bytes(final_norm, shape.hidden, act_dtype)
    shape.root = shape.parameters - sum(p.numel() for _, block in blocks for p in block.parameters())
    for _, block in blocks:
        group = shape.language if id(block) in in_decoder else shape.vision
        if not group.count:
            group.hidden = _width(_children(block)[2][0])
            group.saved_per_position = block_saved_bytes(block, act_dtype)
        group.count += 1
        block_elements = sum(p.numel() for p in block.parameters())
        shape.largest_unit = max(shape.largest_unit, block_elements)
        if group is shape.language:
            shape.quantizable += sum(m.weight.numel() for m in block.modules()
                                     if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad)
    return shape


@dataclass(frozen=True)
class Plan:
    """Bytes per rank of each term, their total, and the positions they were computed for."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    loss: float
    tokens: int
    vision_positions: int

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.loss


def activation_bytes(shape: ModelShape, tokens: int, media_tokens: int, vision_positions: int, recompute: bool,
                     act_bytes: int) -> tuple[float, float]:
    """Saved activations of ``tokens`` language-model positions, ``media_tokens`` of them media, and the vision
    tower's ``vision_positions``: what the forward keeps for the backward, and what the backward adds at its peak
    (with recomputation, the activations of the one block it recomputes at a time)."""
    groups = ((shape.language, tokens), (shape.vision, vision_positions))
    outside = (act_bytes * shape.hidden + shape.per_token) * tokens + shape.per_patch * vision_positions \
        + shape.per_media_token * media_tokens
    if not recompute:
        return outside + sum(g.count * g.saved_per_position * n for g, n in groups), 0.0
    kept = sum(g.count * act_bytes * g.hidden * n for g, n in groups)  # each block's input
    return outside + kept, max(g.saved_per_position * n for g, n in groups)


def loss_bytes(shape: ModelShape, tokens: int, supervised: int, loss_impl: str, chunk_tokens: int,
               act_bytes: int) -> tuple[float, float]:
    """What the loss keeps for the backward beyond the blocks' activations, and what it adds at its peak. Full: it
    keeps the head's input and an fp32 log-softmax of every position (and holds the logits and, when they are not
    fp32, their fp32 copy), its backward adds an fp32 gradient of the logits. Chunked, fused (a plain linear
    head): it keeps the supervised positions' gradient and the head's fp32 gradient (``ModelShape.fused_head``);
    another head: the supervised positions' hidden states and fp32 log-probabilities; either way one chunk's
    logits, their fp32 form and their gradient at a time (the head's input is kept either way)."""
    vocab = shape.vocab
    if loss_impl == "full":
        upcast = 4 if act_bytes != 4 else 0
        return tokens * (act_bytes * shape.hidden + 4 * vocab), tokens * vocab * (act_bytes + upcast + 4)
    chunk = min(chunk_tokens, supervised)  # the head's input is still kept: the first-position check reads it
    per_position = act_bytes * shape.hidden + (0 if shape.fused_head else 4)
    return (tokens * act_bytes * shape.hidden + supervised * per_position + 4 * shape.fused_head,
            chunk * vocab * (act_bytes + 4 + act_bytes))


def plan(shape: ModelShape, settings: Settings, patches_per_media_token: float = 1.0) -> Plan:
    """The per-rank bytes of one training step of ``shape`` under ``settings``."""
    s = settings
    shards = s.world_size if s.sharding == "fsdp2" else 1
    frozen = shape.frozen_bytes
    if s.quantization != "none":
        frozen -= shape.quantizable * shape.dtype_bytes
        frozen += shape.quantizable * QUANTIZED_BYTES[s.quantization]
    parameters = (shape.trainable * shape.dtype_bytes + frozen) / shards
    gradients = shape.trainable * shape.dtype_bytes / shards
    optimizer = shape.trainable * ADAM_BYTES / shards
    if s.offload == "params":
        parameters, gradients, optimizer = 0.0, 0.0, 0.0
    elif s.offload == "optimizer":  # AdamW's state on the host (host_optimizer.py)
        optimizer = 0.0
    if s.sharding == "fsdp2":  # gathered in the compute dtype: the root unit (kept gathered from its forward to
        # its backward) and the block being computed beside the one prefetched
        parameters += (shape.root + 2 * shape.largest_unit) * s.act_bytes
    tokens = s.micro_batch * math.ceil(s.length / s.cp)
    media_tokens = int(tokens * s.media_share)
    vision_positions = int(media_tokens * patches_per_media_token)
    supervised = int(tokens * s.supervised_share)
    activations = activation_bytes(shape, tokens, media_tokens, vision_positions, s.recompute, s.act_bytes)
    loss = loss_bytes(shape, tokens, supervised, s.loss_impl, s.chunk_tokens, s.act_bytes)
    return Plan(parameters, gradients, optimizer, sum(activations), sum(loss), tokens, vision_positions)
