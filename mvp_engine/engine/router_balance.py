"""The load-balancing loss of mixture-of-experts routers, formed so that packing, micro-batching and the world size
leave the objective unchanged.

The loss is transformers' ``load_balancing_loss_func`` (Switch Transformer's, as the MoE VLMs' model code computes
it, pooled over the layers): with ``c[l, e]`` the top-k assignments of tokens to expert ``e`` at MoE layer ``l``,
``s[l, e]`` the sum of their router probabilities and ``N`` the tokens each layer routed,

    aux = E * sum_e f_e * P_e,   f_e = sum_l c[l, e] / (L * N),   P_e = sum_l s[l, e] / (L * N)

and the objective adds ``coef * aux`` to the cross-entropy (``train.router_aux_loss_layers=per_layer``: each layer's
``E * sum_e f[l, e] * P[l, e]`` averaged over the layers instead, Switch Transformer's and Megatron-Core's form; the
same sums, exact in the same way). The model computes it per forward, over whatever the
forward holds: a packed row's padding counts (no ``attention_mask`` reaches it under packing), and a pack of three
samples gives another ``f`` than the three samples one by one, so a packed step is not the step one-by-one training
takes (``tests/test_router_balance.py`` shows it). Here the sums run over the REAL tokens of the whole optimizer
step: every micro-batch, every rank (data- and context-parallel), padding (``pack_segment_ids < 0``) and dummy media
passes never counted. ``aux`` is then one number per step and its gradient, linear in the per-token probabilities,
splits over micro-batches exactly: micro-batch ``m`` contributes ``E * sum_e f_e * sum_l s_m[l, e] / (L * N)``.

The catch is ``f``: it is not differentiated, but a micro-batch's backward needs the whole step's ``f`` and later
micro-batches have not routed yet. Two scopes (``train.router_aux_loss_scope``):

- ``step`` (default): before the step's first backward, a no-grad forward of each of the step's micro-batches counts
  ``c`` and ``N`` (summed over ranks with one all-reduce); the training forwards then use that ``f``. The routing of
  a no-grad forward with the step's weights is the routing of the training forward, so the objective is exactly the
  global one: packed == one-by-one == 1 rank x accumulation N == N ranks x 1. It costs one extra forward per
  micro-batch (about a third more compute, less with activation checkpointing), run under a forked RNG so the
  training forwards draw what they would draw without it.
- ``micro_batch``: each micro-batch's counts are summed over the ranks (one all-reduce per micro-batch) and the
  aux of that global micro-batch is formed, the step's objective being their mean (Megatron-Core's global
  load-balancing loss). Exact over packing within a micro-batch and over data-parallel ranks of the same global
  micro-batch; not over gradient accumulation (a step split into more micro-batches forms ``f`` over fewer tokens).

Aux-loss-free balancing (DeepSeek-V3's expert bias; GLM-4.5V's ``e_score_correction_bias``, which transformers keeps
as a buffer and never updates): where the recipe names its routers' correction bias (``Routers.bias``) and
``train.router_bias_update_rate`` is set, :meth:`RouterBalance.end_step` moves each layer's bias once per optimizer
step, after the update, by ``rate * sign(mean_e c[l, e] - c[l, e])`` (an underloaded expert up, an overloaded one
down) from the step's counts over every rank's real tokens: the same sums on every rank, so the same bias, and the
same whatever the packing or micro-batching. The bias is a persistent buffer of the model, so checkpoints carry it.

A recipe opts in with the ``Recipe.moe_routers`` hook: a function of the model returning :class:`Routers` (its
router modules in layer order, E, k, the model config's coefficient, and how to read probabilities and chosen
experts from a router's output), or None for a model without experts. The engine installs forward hooks on those
modules; they record only inside a step's forwards (never in evaluation, never in an activation-checkpointed
layer's recomputation in backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .config import ConfigError


def softmax_top_k(output: Any, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The default reading of a router's output (transformers' convention: the router logits first, ``[T, E]``):
    the softmax probabilities in fp32 and the ``top_k`` experts chosen from them, as ``load_balancing_loss_func``
    reads ``router_logits``."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    probs = torch.softmax(logits.float(), dim=-1)
    return probs, torch.topk(probs, top_k, dim=-1).indices


@dataclass(frozen=True)
class Routers:
    """What a recipe's ``moe_routers(model)`` hook returns: where the model routes and how to read it.

    ``modules``: one router per MoE layer, in layer order; each is called once per forward on the language model's
    flattened tokens ``[B * L, hidden]`` (this rank's chunk under context parallelism), in the batch's row-major
    order. ``read(output, top_k)`` turns a router's forward output into (probabilities ``[B * L, E]`` fp32, kept in
    the autograd graph; chosen experts ``[B * L, top_k]``). ``aux_loss_coef``: the model config's coefficient where
    the model's own aux loss is on (transformers: ``output_router_logits``), else 0 (what
    ``train.router_aux_loss_coef=null`` resolves to). ``bias``: the name of each router's correction-bias buffer
    ``[E]`` (added to its scores for the choice only) that aux-loss-free balancing moves; empty: none."""

    modules: tuple[torch.nn.Module, ...]
    num_experts: int
    top_k: int
    aux_loss_coef: float = 0.0
    read: Callable[[Any, int], tuple[torch.Tensor, torch.Tensor]] = softmax_top_k
    bias: str = ""


@dataclass
class RouterSums:
    """Per-layer router statistics over some real tokens: top-k assignments ``counts`` ``[L, E]`` (float64, no
    gradient), router probability sums ``probs`` ``[L, E]`` (fp32; in the graph while training) and ``tokens``, the
    real tokens each layer routed."""

    counts: torch.Tensor
    probs: torch.Tensor
    tokens: torch.Tensor

    def detached(self) -> torch.Tensor:
        """One flat float64 tensor of every statistic, for one all-reduce."""
        return torch.cat([self.counts.reshape(-1), self.probs.detach().double().reshape(-1), self.tokens.reshape(1)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, layers: int, experts: int) -> RouterSums:
        size = layers * experts
        return cls(flat[:size].view(layers, experts), flat[size:2 * size].view(layers, experts), flat[-1])


def aux_loss(counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, per_layer: bool = False) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` with ``f`` from ``counts`` and ``P`` from ``probs`` (either a part of the whole's
    ``probs``: the gradient of the whole splits over its parts), both over ``tokens`` real tokens per layer: pooled
    over the layers (transformers'), or ``per_layer``: each layer's ``E * sum_e f[l, e] * P[l, e]``, averaged over
    the layers (Switch Transformer's loss per layer, Megatron-Core's), which also sees a layer whose router collapses
    onto experts another layer leaves idle (pooled, the two look balanced)."""
    layers, experts = counts.shape
    if per_layer:
        denominator = tokens.clamp(min=1.0)
        fraction = (counts / denominator).to(probs.dtype)
        return experts * (fraction * probs / denominator.to(probs.dtype)).sum() / layers
    denominator = (tokens * layers).clamp(min=1.0)
    fraction = (counts.sum(0) / denominator).to(probs.dtype)
    return experts * (fraction * probs.sum(0) / denominator.to(probs.dtype)).sum()


def expert_load(counts: torch.Tensor) -> list[float]:
    """Per layer, the busiest expert's tokens over the mean expert's: 1 balanced, E / k a collapsed router."""
    mean = counts.mean(dim=1).clamp(min=1e-12)
    return [round(float(v), 4) for v in (counts.max(dim=1).values / mean)]


class RouterBalance:
    """The run's router statistics and load-balancing term (module docstring): forward hooks on the recipe's routers
    and the step protocol ``TrainStep`` drives: :meth:`begin_step` (scope ``step``: the counting forwards), per
    micro-batch :meth:`recording` around the training forward and :meth:`micro_batch_loss` after it, and
    :meth:`step_metrics` at the end. With ``coef`` 0 nothing is added to the loss and nothing is counted twice: the
    training forwards' routing is summed for the metrics alone. ``reduce`` sums a tensor over every rank."""

    def __init__(self, routers: Routers, coef: float, scope: str, reduce: Callable[[torch.Tensor], torch.Tensor],
                 bias_rate: float = 0.0, per_layer: bool = False):
        self.routers, self.coef, self.scope, self.reduce = routers, float(coef), scope, reduce
        self._aux = partial(aux_loss, per_layer=per_layer)  # train.router_aux_loss_layers
        self.bias_rate = float(bias_rate)
        self.layers, self.experts = len(routers.modules), routers.num_experts
        self._real: torch.Tensor | None = None  # while recording: the forward's real-token mask [B * L]
        self._tokens = torch.zeros((), dtype=torch.float64)  # the real tokens of the forward recorded last
        self._counts: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._step: RouterSums | None = None  # scope step: the whole step's sums (from the counting forwards)
        self._local: list[torch.Tensor] = []  # coef 0: this rank's flat sums per micro-batch, reduced at the end
        self._seen: list[RouterSums] = []  # the step's sums over every rank so far, for its metrics
        self._aux_values: list[torch.Tensor] = []
        self._handles = [module.register_forward_hook(self._hook(index))
                         for index, module in enumerate(routers.modules)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # --- recording -------------------------------------------------------------------------------------------------

    def _hook(self, index: int):
        def hook(module, args, output):
            if self._real is None:
                return
            # saved for backward with plain hooks: inside an activation-checkpointed layer the checkpoint's own
            # hooks would expect these ops again in its recomputation, where nothing records
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                probs, chosen = self.routers.read(output, self.routers.top_k)
                if probs.shape[0] != self._real.numel():
                    raise RuntimeError(f"router {index} ({type(module).__name__}) routed {probs.shape[0]} rows in a "
                                       f"forward of {self._real.numel()} tokens: Recipe.moe_routers must name "
                                       "routers of the language model's tokens only")
                real = self._real.to(probs.device)
                counts = torch.zeros(self.experts, dtype=torch.float64, device=probs.device)
                counts.index_add_(0, chosen.reshape(-1), real.double().repeat_interleave(chosen.shape[-1]))
                self._counts.append(counts)
                self._probs.append((probs * real.to(probs.dtype).unsqueeze(-1)).sum(0))
        return hook

    @contextmanager
    def recording(self, real: torch.Tensor) -> Iterator[None]:
        """Inside, the routers record over ``real`` (``[B, L]`` bool: the forward's real tokens)."""
        self._real, self._counts, self._probs = real.reshape(-1).float(), [], []
        self._tokens = real.sum().double()
        try:
            yield
        finally:
            self._real = None

    def _recorded(self) -> RouterSums:
        """The sums of the forward recorded last (this rank's)."""
        if len(self._counts) != self.layers:
            raise RuntimeError(f"{len(self._counts)} router calls in a forward, {self.layers} routers named by "
                               "Recipe.moe_routers: each must run once per forward")
        counts = torch.stack(self._counts)
        return RouterSums(counts, torch.stack(self._probs), self._tokens.to(counts.device))

    # --- the step --------------------------------------------------------------------------------------------------

    def begin_step(self, group: list[dict], real: Callable[[dict], torch.Tensor],
                   forward: Callable[[dict], Any], device: torch.device) -> None:
        """Start a step over ``group``. Scope ``step`` with a coefficient: count its routing first, a no-grad
        ``forward`` of each micro-batch (``real(batch)``: its real tokens), the sums added up over the ranks."""
        self._step, self._local, self._seen, self._aux_values = None, [], [], []
        if self.scope != "step" or not self.coef:
            return
        total = torch.zeros(2 * self.layers * self.experts + 1, dtype=torch.float64, device=device)
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for batch in group:
                with self.recording(real(batch)):
                    forward(batch)
                total += self._recorded().detached().to(device)
        self._step = RouterSums.from_flat(self.reduce(total), self.layers, self.experts)
        self._seen = [self._step]
        self._aux_values = [self._aux(self._step.counts, self._step.probs, self._step.tokens)]

    def micro_batch_loss(self, micro_batches: int) -> torch.Tensor | None:
        """``coef`` x this rank's share of the step's aux loss, from the forward just recorded (differentiable in
        its router probabilities): with the whole step's ``f`` (scope ``step``), or the global micro-batch's,
        averaged over the step's ``micro_batches`` (scope ``micro_batch``: one all-reduce here). None with ``coef``
        0 (the sums are kept for the metrics)."""
        local = self._recorded()
        if not self.coef:
            self._local.append(local.detached())
            return None
        if self.scope == "step":
            whole = self._step
        else:
            whole = RouterSums.from_flat(self.reduce(local.detached()), self.layers, self.experts)
            self._seen.append(whole)
            self._aux_values.append(self._aux(whole.counts, whole.probs, whole.tokens) / micro_batches)
        device = local.probs.device
        share = self._aux(whole.counts.to(device), local.probs, whole.tokens.to(device))
        return self.coef * share / (1 if self.scope == "step" else micro_batches)

    def end_step(self) -> None:
        """After the optimizer step: the step's sums over every rank settled (with ``coef`` 0, one all-reduce of the
        metrics' sums), then each router's correction bias moved by ``bias_rate`` from the step's counts (module
        docstring)."""
        if self._local:
            whole = RouterSums.from_flat(self.reduce(sum(self._local)), self.layers, self.experts)
            self._local, self._seen = [], [whole]
            self._aux_values = [self._aux(whole.counts, whole.probs, whole.tokens)]
        if not self.bias_rate or not self.routers.bias or not self._seen:
            return
        counts = sum(s.counts for s in self._seen)
        with torch.no_grad():
            for module, layer in zip(self.routers.modules, counts):
                bias = getattr(module, self.routers.bias)
                bias.add_(torch.sign(layer.mean() - layer).to(bias), alpha=self.bias_rate)

    def step_metrics(self) -> dict:
        """The step's ``aux_loss`` (the term ``coef`` multiplies, over every rank; with ``coef`` 0 what it would
        be under scope ``step``) and ``expert_load`` (per MoE layer, the busiest expert's real tokens over the
        mean expert's)."""
        if self._local:
            whole = RouterSums.from_flat(self.reduce(sum(self._local)), self.layers, self.experts)
            self._seen, self._aux_values = [whole], [self._aux(whole.counts, whole.probs, whole.tokens)]
        counts = sum(s.counts for s in self._seen)
        return {"aux_loss": float(sum(self._aux_values)), "expert_load": expert_load(counts.cpu())}


def recorded_routers(model, read: Callable[[Any, int], tuple[torch.Tensor, torch.Tensor]] = softmax_top_k
                     ) -> Routers | None:
    """The :class:`Routers` a transformers MoE model declares (a ready ``Recipe.moe_routers``): the modules of the
    class its ``_can_record_outputs["router_logits"]`` recorder hooks (what ``output_router_logits`` collects), in
    module order; E and k from those modules' ``num_experts`` / ``top_k``; the coefficient from the text config's
    ``router_aux_loss_coef`` where its ``output_router_logits`` is on. None for a model that declares no router."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    modules = tuple(m for m in model.modules() if recorder is not None and isinstance(m, recorder.target_class))
    if not modules:
        return None
    config = model.config.get_text_config()
    coef = float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0
    return Routers(modules, int(modules[0].num_experts), int(modules[0].top_k), coef, read)


def build_router_balance(routers: Routers | None, coef: float | None, scope: str,
                         reduce: Callable[[torch.Tensor], torch.Tensor], bias_rate: float = 0.0,
                         per_layer: bool = False) -> RouterBalance | None:
    """The run's :class:`RouterBalance` for a model with ``routers`` (None: no experts), ``coef`` being
    ``train.router_aux_loss_coef`` (None: the model config's, ``routers.aux_loss_coef``), ``bias_rate``
    ``train.router_bias_update_rate`` (refused for routers without a correction bias)."""
    if routers is None:
        if coef:
            raise ConfigError(f"train.router_aux_loss_coef={coef!r} needs a mixture-of-experts model: this recipe's "
                              "model has no routers (Recipe.moe_routers)")
        if bias_rate:
            raise ConfigError(f"train.router_bias_update_rate={bias_rate!r} needs a mixture-of-experts model: this "
                              "recipe's model has no routers (Recipe.moe_routers)")
        return None
    if bias_rate and not routers.bias:
        raise ConfigError(f"train.router_bias_update_rate={bias_rate!r} needs routers with a correction bias: "
                          f"{type(routers.modules[0]).__name__} has none (aux-loss-free balancing)")
    return RouterBalance(routers, routers.aux_loss_coef if coef is None else coef, scope, reduce, bias_rate,
                         per_layer)
