"""The loss without the logits (``train.loss_impl=chunked``): the model's final hidden states projected by its own
output head a chunk of supervised positions at a time.

Why: full logits ``[B, L, V]`` and the fp32 copies cross-entropy keeps for backward cost about 10-14 bytes per
token x vocabulary, more than a 7B model's whole state for one packed 32k row at a 152k-262k vocabulary, and
packing fills every row; image tokens and prompts, which are not supervised, were projected too.

How: :class:`HeadInputs`, entered around the model's forward, keeps what the model hands its output head (the module
``get_output_embeddings()`` returns: a tied embedding, a LoRA-wrapped head or a ``modules_to_save`` copy alike,
since it is the module the model itself calls) and lets the model project only each row's first position. Of the
kept hidden states, only the positions whose shifted target is supervised are gathered (labels shifted on the whole
rows, then this context-parallel rank's ``span``, as :mod:`.loss` does); they are projected ``chunk_tokens`` at a
time, each chunk's log-sum-exp and target logit taken in fp32, so no ``positions x V`` tensor lives across chunks
and the loss's peak is about 8 bytes x ``chunk_tokens`` x V. Two ways, by what is known in the forward:

- The loss of a plain linear head (``torch.nn.Linear``, a tied embedding's included: :func:`plain_linear`) is
  fused (:class:`_FusedLinearCrossEntropy`, as Liger's and torchtune's fused linear cross-entropy): the token /
  sample / square weights are known before the loss, so each chunk's gradient wrt its rows and the head's weight is
  formed in the forward and the backward only scales them by ``grad_output``. Three matmuls per chunk, as the full
  logits take.
- Every other head (a LoRA-wrapped head, a ``modules_to_save`` wrapper, a quantized or FSDP2-wrapped linear) and
  the per-token log-probabilities (:func:`chunked_token_logprobs`: a preference loss weighs them by gradients it
  forms after they are known, so nothing can be taken in their forward) go through ``torch.utils.checkpoint`` per
  chunk: the head is called as a module (its adapters, its own gathering of a sharded weight), the forward keeps
  each chunk's log-probabilities and its backward recomputes the chunk's logits (a fourth matmul).

The first-position logits the model still computes prove, on every forward, that the head reproduced here is the
model's (its projection and ``final_logit_softcapping`` where the text config sets one): a model whose head does
more is refused with one line rather than trained on another objective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mvp_engine.kit.mllm.data import IGNORE_INDEX
from mvp_engine.packing import unwrap_model

from . import gpu_losses  # a module: gpu_losses reads .config, which may be importing this one
from .config import GPU_LOSS_IMPLS, ConfigError, TrainSpec
from .loss import WeightedTokenLoss, shifted_targets, token_weights

FULL = "train.loss_impl=full"
CHUNK_TOKENS = TrainSpec.loss_chunk_tokens
# the model's first-position logits against this module's projection of them: within 1 % (about two bf16 steps),
# far inside what a head transform left out changes
PROBE_RTOL, PROBE_ATOL = 1e-2, 1e-3


class _TargetLogProb(torch.autograd.Function):
    """``log_softmax(logits)[target]`` per row in fp32, keeping only the logits (in their own dtype) and the
    log-sum-exp for backward, whose gradient ``onehot - softmax`` is formed in place in one fp32 buffer."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wide = logits.float()
        lse = torch.logsumexp(wide, dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        return wide.gather(1, targets.unsqueeze(1)).squeeze(1) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        gradient = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(1)).exp_()
        gradient.scatter_add_(1, targets.unsqueeze(1), gradient.new_full((len(targets), 1), -1.0))
        return gradient.mul_(-grad.unsqueeze(1)).to(logits.dtype), None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``sum(weights * -log p(target))`` of ``rows`` ``[N, H]`` through a plain linear head (``weight`` ``[V, H]``,
    ``bias``), with every gradient taken in the forward, a chunk at a time: per chunk the logits (soft-capped where
    the model caps them), their fp32 log-sum-exp and target logit, ``d(logits) = weights * (softmax - onehot)``
    formed in place in one fp32 buffer, the chunk's gradient wrt its rows and its sum into the head's gradient. The
    weights are known before the loss (token / sample / square), so nothing of the chunk is needed later: the
    backward only scales the kept gradients by the scalar ``grad_output``. Three matmuls per chunk, as the full
    logits' forward and backward do (the checkpointed path recomputes the logits: four).

    Kept for backward: the rows' gradient (``N x H``) and the head's (``V x H`` fp32, the head's own size), never
    anything ``N x V``. The backward scales them in place, so it runs once (a second one is refused)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, weights, chunk_tokens: int, softcap):
        want_rows, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_rows = torch.empty_like(rows) if want_rows else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        bias_dtype = None if bias is None else bias.dtype
        total = rows.new_zeros((), dtype=torch.float32)
        for start in range(0, len(targets), chunk_tokens):
            part, wanted = rows[start:start + chunk_tokens], targets[start:start + chunk_tokens].unsqueeze(1)
            scale = weights[start:start + chunk_tokens].unsqueeze(1)
            logits, capped = F.linear(part, weight, bias), None
            if softcap is not None:
                capped = logits.div_(softcap).tanh_()
                logits = capped * softcap
            dtype, wide = logits.dtype, logits.float()  # the logits themselves where they are fp32
            del logits  # each chunk's temporaries go before the next chunk's are made
            target_logit = wide.gather(1, wanted)
            peak = wide.amax(1, keepdim=True)
            sums = wide.sub_(peak).exp_().sum(1, keepdim=True)
            total += (scale * (peak + sums.log() - target_logit)).sum()
            if want_rows or want_weight or want_bias:
                gradient = wide.mul_(scale / sums).scatter_add_(1, wanted, -scale)  # weights * (softmax - onehot)
                if capped is not None:  # d cap*tanh(z/cap) / dz = 1 - tanh^2
                    gradient.mul_(capped.float().square_().neg_().add_(1))
                del wide, capped
                gradient = gradient.to(dtype)
                if want_rows:
                    grad_rows[start:start + chunk_tokens] = gradient @ weight
                if want_weight:
                    grad_weight += gradient.t() @ part
                if want_bias:
                    grad_bias += gradient.sum(0)
                del gradient
            else:
                del wide, capped
        ctx.save_for_backward(*(g for g in (grad_rows, grad_weight, grad_bias) if g is not None))
        ctx.kept, ctx.dtypes, ctx.used = (want_rows, want_weight, want_bias), (weight.dtype, bias_dtype), False
        return total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.used:
            raise RuntimeError("the fused linear cross-entropy's gradients were taken in its forward and scaled in "
                               "its first backward: it cannot be backpropagated twice")
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        grads = [next(saved).mul_(grad_output) if kept else None for kept in ctx.kept]
        for index, dtype in ((1, ctx.dtypes[0]), (2, ctx.dtypes[1])):
            if grads[index] is not None:
                grads[index] = grads[index].to(dtype)
        return (*grads, None, None, None, None)


def project(head: torch.nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logits as the model forms them: its head, then soft-capping (``cap * tanh(logits / cap)``, in the logits'
    dtype and order of operations) where the model has it."""
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                    softcap: float | None) -> torch.Tensor:
    return _TargetLogProb.apply(project(head, hidden, softcap), targets)


def target_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, chunk_tokens: int,
                    softcap: float | None = None) -> torch.Tensor:
    """``log p(target)`` (fp32) of each row of ``hidden`` ``[N, H]`` with ``targets`` ``[N]``, ``chunk_tokens`` rows
    projected at a time; under autograd each chunk is checkpointed, so its logits are recomputed in backward."""
    pieces = []
    for start in range(0, len(targets), chunk_tokens):
        rows, wanted = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, rows, wanted, head, softcap, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(rows, wanted, head, softcap))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def supervised_rows(hidden: torch.Tensor, labels: torch.Tensor, span: tuple[int, int] | None = None):
    """The hidden states ``[N, H]`` of the positions whose shifted target is supervised, those targets ``[N]``, where
    they sit (``[B, L-1]``, or ``[B, end - start]`` with ``span``: ``hidden`` is then positions ``[start, end)`` of
    the rows) and their flat indices into that. Gathered by one index (one read-back of ``N`` on a GPU, where three
    boolean selections made three)."""
    targets = shifted_targets(labels, span)
    where = targets != IGNORE_INDEX
    flat = where.reshape(-1).nonzero().squeeze(1)
    width = where.shape[1]
    rows = flat + flat.div(width, rounding_mode="floor") * (hidden.shape[1] - width)  # rows of hidden's [B*L, H]
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), targets.reshape(-1)[flat], where, flat


def plain_linear(head: torch.nn.Module) -> bool:
    """Whether ``head`` computes ``F.linear(x, weight, bias)`` and nothing else: a ``torch.nn.Linear`` itself (a tied
    embedding's head is one), no hook around it, its weight a whole tensor (the root's parameters under FSDP2 stay
    unsharded from the forward to the backward). Only such a head takes the fused loss, whose gradients are formed
    from its weight directly; a LoRA-wrapped head, a ``modules_to_save`` wrapper, a quantized or FSDP2-wrapped
    linear (subclasses) compute more or gather their weight in their own call, so they are called as modules on the
    checkpointed path."""
    return (type(head) is torch.nn.Linear and not isinstance(head.weight, DTensor)
            and not (head._forward_hooks or head._forward_pre_hooks))


def chunked_token_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                       segment_ids: torch.Tensor, reduction: str, span: tuple[int, int] | None = None,
                       chunk_tokens: int = CHUNK_TOKENS, softcap: float | None = None) -> WeightedTokenLoss:
    """:func:`.loss.weighted_token_loss` from the hidden states the head projects (``[B, L, H]``, or this CP rank's
    ``span`` of the rows) instead of the logits: the same weights, the same fp32 cross-entropy."""
    weights = token_weights(labels, segment_ids, reduction, span)
    rows, targets, _, flat = supervised_rows(hidden, labels, span)
    row_weights = weights.reshape(-1)[flat].to(torch.float32)
    if torch.is_grad_enabled() and plain_linear(head):
        weighted = _FusedLinearCrossEntropy.apply(rows, head.weight, head.bias, targets, row_weights, chunk_tokens,
                                                  softcap)
    else:
        weighted = -(target_logprobs(rows, targets, head, chunk_tokens, softcap) * row_weights).sum()
    return WeightedTokenLoss(weighted, weights.sum())


def chunked_token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                           span: tuple[int, int] | None = None, chunk_tokens: int = CHUNK_TOKENS,
                           softcap: float | None = None) -> torch.Tensor:
    """Per-token ``log p(next token)`` of a packed batch (fp32, ``[B, L-1]`` or the ``span``'s width), 0 where the
    target is not supervised: what a preference loss or an RL engine needs, without the logits (differentiable)."""
    rows, targets, where, _ = supervised_rows(hidden, labels, span)
    logprobs = target_logprobs(rows, targets, head, chunk_tokens, softcap)
    return logprobs.new_zeros(where.shape).masked_scatter(where, logprobs)


class HeadInputs:
    """Entered around one forward of ``model``: keeps the hidden states the model hands its output head and lets it
    project only each row's first position. Then :meth:`loss` or :meth:`token_logprobs`, given that forward's
    ``logits``, run the chunked path (``impl`` liger or cce: :meth:`loss` through that fused kernel,
    ``gpu_losses.py``); call them under the forward's autocast, so the head computes in the same
    precision it did inside the forward."""

    def __init__(self, model, impl: str = "chunked"):
        inner = unwrap_model(model)
        self.impl = impl
        self.head = inner.get_output_embeddings()
        if self.head is None:
            raise ConfigError(f"train.loss_impl=chunked: {type(inner).__name__} names no output head "
                              f"(get_output_embeddings() is None); use {FULL}")
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.head.modules()):
            raise ConfigError("train.loss_impl=chunked: the output head has dropout (an adapter on it with "
                              f"model.lora.dropout > 0), which each chunk would draw anew; set it to 0 or use {FULL}")
        if impl in GPU_LOSS_IMPLS:
            gpu_losses.check_head(self.head, impl)
        self.softcap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None)
        self.model_name = type(inner).__name__
        self.kept: list[torch.Tensor] = []

    def __enter__(self) -> HeadInputs:
        self.kept.clear()
        self._handle = self.head.register_forward_pre_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _keep(self, module, args):
        if not args:
            raise ConfigError(f"train.loss_impl=chunked: {self.model_name} calls its output head without positional "
                              f"hidden states; use {FULL}")
        self.kept.append(args[0])
        return (args[0][..., :1, :], *args[1:])

    def hidden(self, logits: torch.Tensor) -> torch.Tensor:
        """The hidden states the forward that returned ``logits`` handed its head, once those logits (each row's
        first position) are checked to be :func:`project` of them; one line otherwise."""
        if len(self.kept) != 1:
            raise ConfigError(f"train.loss_impl=chunked: {self.model_name} called its output head "
                              f"{len(self.kept)} times in one forward, not once; use {FULL}")
        hidden = self.kept[0]
        with torch.no_grad():
            ours = project(self.head, hidden[..., :1, :], self.softcap)
        if ours.shape != logits.shape or not torch.allclose(ours.float(), logits.float(), PROBE_RTOL, PROBE_ATOL):
            cap = f"final_logit_softcapping={self.softcap}" if self.softcap is not None else "no soft-capping"
            raise ConfigError(f"train.loss_impl=chunked: {self.model_name}'s logits are not its output head's "
                              f"projection with {cap} (its head does more); use {FULL}")
        return hidden

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor, reduction: str,
             span: tuple[int, int] | None = None, chunk_tokens: int = CHUNK_TOKENS) -> WeightedTokenLoss:
        """:func:`chunked_token_loss` of the forward that returned ``logits``. Zero times those logits is added, so
        the head and every layer below it take part in the backward (with zero gradients) on a micro-batch with
        nothing supervised, as the full logits made them."""
        hidden = self.hidden(logits)
        if self.impl in GPU_LOSS_IMPLS:  # train.loss_impl=liger | cce: a fused kernel over the same rows
            rows, targets, _, flat = supervised_rows(hidden, labels, span)
            part = gpu_losses.fused_token_loss(self.impl, rows, targets, flat, self.head, labels, segment_ids,
                                               reduction, span, self.softcap)
        else:
            part = chunked_token_loss(hidden, self.head, labels, segment_ids, reduction, span, chunk_tokens,
                                      self.softcap)
        return WeightedTokenLoss(part.weighted_sum + logits.float().sum() * 0.0, part.weight_total)

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, span: tuple[int, int] | None = None,
                       chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
        """:func:`chunked_token_logprobs` of the forward that returned ``logits``."""
        return chunked_token_logprobs(self.hidden(logits), self.head, labels, span, chunk_tokens, self.softcap)
