"""Which parameters train, and making every trainable one take part in every backward.

Data parallelism (DDP without an unused-parameter search) needs every trainable parameter to receive a gradient
on every rank at every step; so does exact equivalence between N ranks and one rank accumulating N micro-batches:
AdamW skips a parameter whose gradient is None but applies momentum and weight decay to a zero gradient, so
"no gradient" and "zero gradient" must never depend on how the micro-batches fell on ranks. Two rules give that:

- Parameters no forward can reach (LLaVA's vision layers after ``vision_feature_layer``) are frozen at build time,
  named by the recipe's ``unreachable_parameters`` hook, and so are those matching ``model.freeze``.
- A micro-batch without media of a kind the model takes adds a zero-weighted pass of the media encoder over the
  recipe's tiny dummy input (``dummy_media``) per encoder it leaves unused (kinds declared on one tower,
  ``MediaKind.on_tower_of``, share one; under FSDP2 one per missing kind: :func:`dummy_passes`), as InternVL and
  LLaMA-Factory do: the media parameters get an exact zero gradient, on one rank as on N, and the loss and every
  other gradient are unchanged.
  It runs where a real image's encoder pass runs, at the start of the model's forward
  (:func:`forward_with_media_pass`), so every rank runs the encoder as many times, in the same order, whatever
  media its micro-batch holds (FSDP2 gathers each vision block when it is called).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch

from mvp_engine.kit.mllm.data.media import IMAGES, VIDEOS, MediaKind
from mvp_engine.packing import unwrap_model

from .config import ConfigError


@dataclass
class ParameterReport:
    """What trains, for the start-of-run line and ``summary.json``."""

    total: int
    trainable: int
    frozen_by_config: list[str] = field(default_factory=list)
    frozen_unreachable: list[str] = field(default_factory=list)

    def describe(self) -> str:
        line = f"parameters: {self.trainable:,} trainable of {self.total:,}"
        if self.frozen_by_config:
            line += f"; model.freeze froze {len(self.frozen_by_config)} tensors"
        if self.frozen_unreachable:
            line += (f"; froze {len(self.frozen_unreachable)} tensors no forward reaches "
                     f"(e.g. {self.frozen_unreachable[0]})")
        return line

    def to_dict(self) -> dict:
        return {"total": self.total, "trainable": self.trainable, "frozen_by_config": len(self.frozen_by_config),
                "frozen_unreachable": self.frozen_unreachable}


def _matches(name: str, pattern: str) -> bool:
    """A pattern names a module (every parameter under it) or a parameter, with fnmatch wildcards."""
    return fnmatch(name, pattern) or fnmatch(name, f"{pattern}.*")


def freeze_parameters(model: torch.nn.Module, patterns, unreachable: list[str]) -> ParameterReport:
    """Freeze ``model.freeze`` patterns and the unreachable parameters; a pattern matching nothing is an error."""
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns or ()):
        raise ConfigError(f"model.freeze={patterns!r} is invalid: allowed a list of module-name patterns")
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns or ():
        if not any(_matches(name, pattern) for name in names):
            raise ConfigError(f"model.freeze: pattern {pattern!r} matches no parameter (names look like "
                              f"{names[0]!r})")
    by_config, by_reach = [], []
    for name, param in model.named_parameters():
        if any(_matches(name, p) for p in patterns or ()):
            by_config.append(name)
        elif name in unreachable:
            by_reach.append(name)
        else:
            continue
        param.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError("model.freeze leaves no trainable parameter")
    return ParameterReport(total, trainable, by_config, by_reach)


def has_media(batch: dict) -> bool:
    return int(batch["media_tokens"].sum()) > 0


def media_kinds(model, encoder=None) -> tuple[MediaKind, ...]:
    """The media kinds a micro-batch may hold, one encoder pass each: those the model's forward encodes (images, and
    videos where it has ``get_video_features``) that the recipe's ``encoder`` feeds (its ``media_kinds``, which
    carry the model's own per-item fields: context parallelism hands them to the vision tower with each share).

    What is fed decides, not only what the model could take: a kind no rank is ever fed needs no dummy pass (the
    passes still match across ranks), and a model taking video beside a recipe feeding none (Gemma 4: its
    ``Gemma4Model.get_video_features``; the class the recipe trains does not expose it, which alone kept its dummy
    video pass away) would otherwise encode the dummy input twice on every micro-batch. Skipping a kind leaves no
    parameter out of a backward only where its path has no parameter of its own (Gemma 4's video path is its image
    path: ``tests/test_dummy_passes.py``); a model with such parameters names them in ``unreachable_parameters``.
    Without an encoder, or one that does not say (no ``media_kinds``), every kind the model encodes counts as fed,
    read as the kit's generic kinds: one pass too many costs time, one too few would leave a parameter out of a
    backward."""
    kinds = (IMAGES, VIDEOS) if hasattr(unwrap_model(model), "get_video_features") else (IMAGES,)
    fed = getattr(encoder, "media_kinds", None)
    return kinds if fed is None else tuple(kind for kind in fed if kind.name in {k.name for k in kinds})


def dummy_passes(batch: dict, kinds: tuple[MediaKind, ...], per_kind: bool = False) -> int:
    """Dummy media passes a micro-batch needs for every media parameter to take part in its backward: one per media
    encoder (``MediaKind.tower_name``) none of whose kinds it holds. Kinds on one tower share its parameters, so an
    image gives the tower a gradient for the videos too: a micro-batch with images and no clip runs no dummy pass,
    a text-only one a single pass for the shared tower.

    ``per_kind`` (FSDP2): one per media kind it holds none of. A forward runs the encoder once per kind present, so
    with these every micro-batch on every rank runs it ``len(kinds)`` times: the same collectives (an image-only
    rank beside an image-and-video rank would otherwise gather the vision blocks once where the other gathers them
    twice)."""
    missing = [kind for kind in kinds if batch.get(kind.patch_key) is None or not batch[kind.patch_key].numel()]
    if per_kind:
        return len(missing)
    present = {kind.tower_name for kind in kinds if kind not in missing}
    return len({kind.tower_name for kind in missing} - present)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # transformers' ModelOutput is a dict
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def dummy_media_loss(model, dummy_inputs: dict) -> torch.Tensor:
    """Zero times the media encoder's output on the dummy input: an exact zero gradient for every media parameter.

    The encoder is called through the model's own ``get_image_features`` (every transformers VLM has one), outside
    the DDP wrapper's forward; DDP's gradient hooks sit on the parameters, so the backward still reaches them. Its
    ``pooler_output`` (and, for Qwen3-VL's DeepStack, its ``deepstack_features``) is what the language model
    consumes, so the dummy reaches exactly what a real image does.
    """
    inner = unwrap_model(model)
    device = next(inner.parameters()).device
    outputs = inner.get_image_features(**{k: v.to(device) for k, v in dummy_inputs.items()})
    consumed = [getattr(outputs, key, None) for key in ("pooler_output", "deepstack_features")]
    features = [part for part in consumed if part is not None] or outputs
    total = sum(t.float().sum() for t in _tensors(features) if t.is_floating_point())
    return total * 0.0


def forward_with_media_pass(model, kwargs: Mapping, dummy_inputs: dict, passes: int,
                            encode: Callable[[torch.nn.Module], tuple[dict, torch.Tensor | None]] | None = None,
                            autocast: Callable[[], AbstractContextManager] = nullcontext):
    """``model(**kwargs)`` and, when ``passes`` (:func:`dummy_passes`) is not 0, the zero loss of that many dummy
    media passes (else None). ``encode`` (context parallelism: ``sequence_media.encode_media_shares``) runs in the
    same place and hands the model its ``mm_encoder_outputs`` (plus any zero loss of its own dummy passes).

    The pass is a forward pre-hook of the transformers model, so it runs inside the forward of any wrapper (DDP,
    FSDP2) and before the language model, as a real image's encoder pass does: FSDP2's own pre-hook (registered
    first, with ``prepend``) has gathered the root's parameters, and the vision blocks are gathered in the same
    order on every rank, before the decoder layers, whether the rank's micro-batch has media or not.

    A pre-hook runs before the model's ``forward``, so outside the autocast accelerate wraps that ``forward`` in:
    ``autocast`` is that context (``TrainStep.forward_autocast``), entered around the passes so the vision tower
    computes in the precision the model's own image passes do (flash kernels refuse fp32).
    """
    if not passes and encode is None:
        return model(**kwargs), None
    losses = []

    def before_forward(module, args, module_kwargs):
        with autocast():
            if passes:
                losses.append(sum(dummy_media_loss(module, dummy_inputs) for _ in range(passes)))
            if encode is not None:
                encoder_outputs, zero = encode(module)
                module_kwargs = {**module_kwargs, "mm_encoder_outputs": encoder_outputs}
                if zero is not None:
                    losses.append(zero)
        return args, module_kwargs

    hook = unwrap_model(model).register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        outputs = model(**kwargs)
    finally:
        hook.remove()
    return outputs, (sum(losses) if losses else None)
