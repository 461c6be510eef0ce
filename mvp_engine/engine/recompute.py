"""Activation checkpointing (``train.activation_checkpointing``): every decoder layer and vision block keeps only its
inputs in the forward and recomputes its activations in the backward (non-reentrant), trading one more forward per
step for the memory of everything inside the blocks.

transformers' own switch covers every recipe's model in 5.24 (measured: the repeated blocks of LLaVA (Llama decoder
layers, CLIP encoder layers), Qwen2-VL, Qwen3-VL and Qwen3.5 (decoder layers and vision blocks) are all
``GradientCheckpointingLayer``s), so no block is wrapped by hand. It checkpoints each layer's ``forward``, not its
``__call__``, so module hooks (FSDP2's unshard / reshard) stay outside the recompute: it must be switched on before
``fully_shard`` wraps the layers, the order torchtitan uses. The recompute replays the layer's forward with the same
kwargs (masks, ``cu_seq_lens_q`` of the linear-attention layers, DeepStack features are added outside the layers),
so the gradients are those of the run without it (``testkit/recompute.py`` checks every recipe). Under context
parallelism the replay runs in backward, after the forward's CP shard was left: ``replay_sequence_shard`` re-enters
it for the recompute, so the replayed all-to-alls are the forward's.

:class:`SavedForBackward` counts what a forward leaves for its backward, exactly, from the tensors: the bench and the
testkit's proof that recomputation happened both read it.
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from mvp_engine.packing import replay_sequence_shard, unwrap_model

from .config import ConfigError


def checkpointing_layers(model) -> list[GradientCheckpointingLayer]:
    """The model's layers transformers can recompute (whether switched on or not)."""
    return [m for m in unwrap_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def uncovered_blocks(model) -> list[str]:
    """Block classes the model repeats (its ``_no_split_modules`` found more than once) that cannot recompute."""
    inner = unwrap_model(model)
    counts = Counter(type(m).__name__ for m in inner.modules())
    layers = {type(m).__name__ for m in checkpointing_layers(inner)}
    return sorted(name for name in (getattr(inner, "_no_split_modules", None) or ())
                  if counts[name] > 1 and name not in layers)


def enable_activation_checkpointing(model):
    """Recompute every decoder layer and vision block of ``model`` in backward (non-reentrant); returns the model.
    A model with a repeated block transformers cannot recompute is refused with one line (``ConfigError``) rather
    than half checkpointed."""
    inner = unwrap_model(model)
    missing = uncovered_blocks(inner)
    if not inner.supports_gradient_checkpointing or not checkpointing_layers(inner) or missing:
        why = f"its blocks {missing} are not" if missing else "it has no"
        raise ConfigError(f"train.activation_checkpointing=true: {type(inner).__name__} cannot recompute its layers "
                          f"({why} transformers GradientCheckpointingLayers)")
    inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": replay_sequence_shard})
    return model


def recomputes(layer: torch.nn.Module) -> bool:
    """True when ``layer`` will recompute its forward in backward (checkpointing on, training, grad enabled)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training and torch.is_grad_enabled()


class SavedForBackward:
    """Bytes a forward run inside the block leaves for its backward: the tensors autograd saves outside checkpointed
    layers (``saved_tensors_hooks``) plus the inputs each checkpointed layer holds for its recompute (a forward
    pre-hook; ops inside the layer save only placeholders). Every storage counted once, at its full size; the
    model's parameters and buffers, which exist anyway, are left out. Holds the tensors until the block ends."""

    def __init__(self, model) -> None:
        self.model = unwrap_model(model)
        self.bytes = 0
        self._seen: dict[int, torch.Tensor] = {}

    def _add(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and key not in self._resident:
            self._seen[key] = tensor
            self.bytes += storage.nbytes()

    def _pack(self, tensor):
        self._add(tensor)
        return tensor

    def _layer_inputs(self, layer, args, kwargs) -> None:
        if recomputes(layer):
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    self._add(tensor)

    def __enter__(self) -> SavedForBackward:
        self._resident = {t.untyped_storage().data_ptr()
                          for t in (*self.model.parameters(), *self.model.buffers())}
        self._handles = [layer.register_forward_pre_hook(self._layer_inputs, with_kwargs=True)
                         for layer in checkpointing_layers(self.model)]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._seen.clear()
