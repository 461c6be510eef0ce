"""Preference optimisation (``train.objective=dpo``): DPO-family losses over packed preference pairs.

A pair is one packing item (``mvp_engine.kit.mllm.data.pairs``): one segment holding a prefix, then the chosen and
the rejected continuation, or (the prefix duplicated) its two conversations as two segments; ``pair_branch_ids``
tells the answers apart. One forward of the model gives both answers' per-token
log-probabilities through the chunked path (``linear_loss.chunked_token_logprobs``: the supervised positions
projected a chunk at a time, no logits); summed per continuation they are what every DPO variant reads.

Losses (``dpo.loss_type``; ``d = beta * ((pi_c - ref_c) - (pi_r - ref_r))`` with summed log-probs):

- ``sigmoid`` (DPO): ``-(1 - eps) * logsigmoid(d) - eps * logsigmoid(-d)``, ``eps = dpo.label_smoothing``;
- ``ipo``: ``(h - 1 / (2 * beta))**2`` with ``h`` the same log-ratio difference of token-MEAN log-probs;
- ``hinge``: ``relu(1 - d)``;
- ``simpo``: ``-(1 - eps) * logsigmoid(s) - eps * logsigmoid(-s)``, ``s = beta * (mean pi_c - mean pi_r) -
  dpo.simpo_gamma``: no reference model.

``dpo.sft_weight`` adds ``w * mean token NLL of the chosen answer`` per pair. Rewards are ``beta * (pi - ref)``
(SimPO: ``beta * mean pi``); accuracy is the share of pairs whose chosen reward is higher.

Exact under accumulation and data parallelism as the SFT reductions are: the step's loss is the sum of its pairs'
losses over the number of pairs in the step (every micro-batch, every rank), each pair whole in one micro-batch.

The reference model (``dpo.reference``): ``adapters_off`` runs the policy itself with its LoRA adapters disabled
(no second copy); ``copy`` a frozen copy taken before training; ``precomputed`` looks each pair's reference
log-probabilities up by its record key in a table computed in one pass before training (``reference_logps.py``).

Held-out pairs (``data.eval_sources``) are read, planned and packed as the training pairs are
(:func:`eval_pairs`), and evaluated with the same objective: loss, rewards, margin, accuracy (``evaluation.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMDataSpec
from mvp_engine.kit.mllm.data.pairs import BRANCH_FIELD, CHOSEN, REJECTED, PairEncoder, PreferenceRecord
from mvp_engine.kit.mllm.data.preference_sources import read_preference_records
from mvp_engine.packing import has_layer_types, has_linear_attention, shared_prefix_obstacle, unwrap_model

from .config import ConfigError, PreferenceSpec, RunSpecs
from .device import cuda_in_use
from .linear_loss import CHUNK_TOKENS, HeadInputs
from .loss import WeightedTokenLoss
from .sharding import is_sharded

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
           "logps/rejected")


@dataclass
class PairLogProbs:
    """Per pair of a batch (row-major, segment order): each continuation's summed log-probability and token count."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def _pair_owners(segment_ids: torch.Tensor, branches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One id per (row, segment) of every position, and the sorted ids of the segments that are pairs."""
    width = segment_ids.shape[1]
    rows = torch.arange(segment_ids.shape[0], device=segment_ids.device).unsqueeze(1)
    owner = rows * (width + 1) + segment_ids + 1
    return owner, torch.unique(owner[branches == CHOSEN])


def count_pairs(batch: dict) -> int:
    """The preference pairs of ``batch`` (segments holding a chosen continuation)."""
    branches = batch.get(BRANCH_FIELD)
    if branches is None:
        return 0
    return int(_pair_owners(batch["pack_segment_ids"], branches)[1].numel())


def pair_logprobs(token_logprobs: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor,
                  branches: torch.Tensor) -> PairLogProbs:
    """Sums of ``token_logprobs`` (``[B, L-1]``: position t's log-probability of token t + 1, 0 where unsupervised)
    over each pair's chosen and rejected targets."""
    owner, pairs = _pair_owners(segment_ids, branches)
    owner, target_branch = owner[:, 1:], branches[:, 1:]
    supervised = labels[:, 1:] != IGNORE_INDEX
    sums, counts = [], []
    for branch in (CHOSEN, REJECTED):
        mask = supervised & (target_branch == branch)
        owners = owner[mask]
        if branch == REJECTED:  # a duplicated-prefix pair's rejected conversation is the segment after its chosen one
            owners = torch.where(torch.isin(owners, pairs), owners, owners - 1)
        index = torch.searchsorted(pairs, owners)
        sums.append(token_logprobs.new_zeros(len(pairs)).index_add(0, index, token_logprobs[mask]))
        counts.append(torch.zeros(len(pairs), dtype=token_logprobs.dtype, device=pairs.device)
                      .index_add_(0, index, torch.ones_like(token_logprobs[mask])))
    if bool((torch.stack(counts) == 0).any()):
        raise ValueError("a preference pair has a continuation without supervised tokens")
    return PairLogProbs(sums[0], sums[1], counts[0], counts[1])


def preference_losses(policy: PairLogProbs, reference: PairLogProbs | None,
                      spec: PreferenceSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss (module docstring), the chosen and the rejected reward (detached)."""
    beta, eps = spec.beta, spec.label_smoothing
    if spec.loss_type == "simpo":
        chosen, rejected = policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens
        logits = beta * (chosen - rejected) - spec.simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        rewards = beta * chosen, beta * rejected
    else:
        if reference is None:
            raise ValueError(f"dpo.loss_type={spec.loss_type} needs reference log-probabilities")
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        rewards = beta * chosen, beta * rejected
        if spec.loss_type == "ipo":
            mean_ratio = chosen / policy.chosen_tokens - rejected / policy.rejected_tokens
            losses = (mean_ratio - 1 / (2 * beta)) ** 2
        elif spec.loss_type == "hinge":
            losses = torch.relu(1 - beta * (chosen - rejected))
        else:
            logits = beta * (chosen - rejected)
            losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    if spec.sft_weight:
        losses = losses - spec.sft_weight * policy.chosen / policy.chosen_tokens
    return losses, rewards[0].detach(), rewards[1].detach()


def batch_pair_logprobs(model, batch: dict, forward: Callable, autocast: Callable = nullcontext,
                        chunk_tokens: int = CHUNK_TOKENS):
    """The pairs' log-probabilities under ``model`` (``forward(model, batch) -> (outputs, dummy loss)``: the step's
    forward with its dummy media passes), the dummy loss, and zero times the first-position logits (so the head takes
    part in every backward, as ``HeadInputs.loss`` does)."""
    with HeadInputs(model) as head:
        outputs, dummy = forward(model, batch)
    with autocast():
        tokens = head.token_logprobs(outputs.logits, batch["labels"], None, chunk_tokens)
    logprobs = pair_logprobs(tokens, batch["labels"], batch["pack_segment_ids"], batch[BRANCH_FIELD])
    return logprobs, dummy, outputs.logits.float().sum() * 0.0


@contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """``model`` computing as its base: every LoRA layer's adapters off (peft's own switch), trainability restored
    after. One line where the model has no adapters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in unwrap_model(model).modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ConfigError("dpo.reference=adapters_off needs LoRA adapters (model.lora.r > 0): without them the "
                          "policy is its own reference; use dpo.reference=copy")
    trainable = {p: p.requires_grad for p in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in trainable.items():
            param.requires_grad_(flag)


def frozen_copy(model) -> torch.nn.Module:
    """``dpo.reference=copy``: the model as it is now, frozen, in eval mode (no dropout)."""
    reference = copy.deepcopy(unwrap_model(model))
    return reference.requires_grad_(False).eval()


class PreferenceObjective:
    """The step's objective under ``train.objective=dpo``: the weight of a micro-batch (its pairs), its loss parts
    and the step's metrics. ``reference``: the frozen copy under ``dpo.reference=copy``; ``lookup``: under
    ``precomputed``, the batch's pairs' reference log-probabilities (``reference_logps.ReferenceTable``, set before
    the first step)."""

    def __init__(self, spec: PreferenceSpec, reference: torch.nn.Module | None = None):
        if spec.needs_reference and spec.reference == "copy" and reference is None:
            raise ValueError("dpo.reference=copy needs the frozen copy (preference.frozen_copy)")
        self.spec = spec
        self.reference = reference
        self.lookup: Callable[[dict], PairLogProbs] | None = None
        self._totals = torch.zeros(len(METRICS) + 1, dtype=torch.float64)

    def weights(self, batch: dict) -> int:
        return count_pairs(batch)

    def reference_logprobs(self, model, batch: dict, forward: Callable, autocast: Callable,
                           chunk_tokens: int) -> PairLogProbs | None:
        if not self.spec.needs_reference:
            return None
        if self.spec.reference == "precomputed":
            if self.lookup is None:
                raise RuntimeError("dpo.reference=precomputed: the reference pass has not run "
                                   "(reference_logps.attach_precomputed_reference)")
            return self.lookup(batch)
        with torch.no_grad():
            if self.spec.reference == "copy":
                logprobs = batch_pair_logprobs(self.reference, batch, forward, autocast, chunk_tokens)[0]
                if is_sharded(self.reference):  # FSDP2 keeps the root gathered for a backward the copy never runs
                    self.reference.reshard()
                return logprobs
            with adapters_disabled(model):
                return batch_pair_logprobs(model, batch, forward, autocast, chunk_tokens)[0]

    def loss(self, model, batch: dict, forward: Callable, autocast: Callable = nullcontext,
             chunk_tokens: int = CHUNK_TOKENS) -> tuple[WeightedTokenLoss, torch.Tensor | None]:
        """The micro-batch's summed pair losses and pair count, and the dummy media loss."""
        reference = self.reference_logprobs(model, batch, forward, autocast, chunk_tokens)
        policy, dummy, zero = batch_pair_logprobs(model, batch, forward, autocast, chunk_tokens)
        losses, chosen, rejected = preference_losses(policy, reference, self.spec)
        stats = torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).sum(),
                             policy.chosen.detach().sum(), policy.rejected.detach().sum(),
                             torch.tensor(float(len(losses)), device=losses.device)])
        self._totals += stats.double().cpu()
        return WeightedTokenLoss(losses.sum() + zero, torch.tensor(float(len(losses)))), dummy

    def take_totals(self) -> torch.Tensor:
        """This rank's sums since the last call (``METRICS``, then the pair count), reset. An evaluation, which runs
        between steps, takes its own this way."""
        totals, self._totals = self._totals, torch.zeros_like(self._totals)
        return totals

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
        """The step's means per pair (``reduce``: the sum over ranks), then reset for the next step."""
        return pair_means(reduce(self.take_totals()).cpu())


def pair_means(totals: torch.Tensor) -> dict[str, float]:
    """Each of ``METRICS`` per pair, from the sums :meth:`PreferenceObjective.take_totals` gives."""
    pairs = float(totals[-1])
    return {name: float(value) / max(pairs, 1.0) for name, value in zip(METRICS, totals[:-1].tolist())}


# --- a run's parts under train.objective=dpo (run.py) ----------------------------------------------------------


def preference_spec(cfg, specs: RunSpecs, training: bool = True) -> PreferenceSpec | None:
    """The validated ``dpo.*`` of a run whose ``train.objective`` is dpo (None under sft); one line for what such a
    run cannot do yet: unpacked pairs, context parallelism; and, evaluating a saved policy (``training`` False), a
    reference that would be the policy itself (``copy``) or is made by a training run (``precomputed``)."""
    spec = specs.dpo
    if spec is None:
        return None
    if not training and spec.needs_reference and spec.reference != "adapters_off":
        raise ConfigError(f"evaluate: dpo.reference={spec.reference} has no reference for a saved policy (a copy "
                          "would be the policy itself; precomputed log-probs come from a training run's initial "
                          "model): use dpo.reference=adapters_off with a LoRA adapter folder (its base is the "
                          "reference), or dpo.loss_type=simpo")
    if specs.data.packing is None:
        raise ConfigError("train.objective=dpo packs each pair as one item: add +packing=greedy (or bfd)")
    if specs.train.context_parallel_size != 1:
        raise ConfigError("train.objective=dpo with train.context_parallel_size > 1 is not supported yet")
    obstacle = shared_prefix_obstacle(specs.attention, _device_type())
    if obstacle is not None and str(cfg.attention.implementation) == "auto" and spec.shared_prefix:
        specs.attention, specs.attention_why = "sdpa", f"train.objective=dpo: {obstacle}, sdpa masks a shared prefix"
    return spec


def prefix_obstacle(model, attention: str) -> str | None:
    """Why ``model`` on ``attention`` cannot keep two continuations of one segment apart (None: it can): then each
    pair is laid out as its two conversations (the prefix duplicated), which every packed path computes exactly."""
    if has_linear_attention(model):
        return "its linear-attention layers carry a recurrent state along the segment"
    if has_layer_types(unwrap_model(model).config.get_text_config()):
        return "its sliding windows count row indices, not positions"
    return shared_prefix_obstacle(attention, _device_type())


def _device_type() -> str:
    """The device type this process trains on: whether sdpa_varlen can merge a shared prefix depends on it."""
    return "cuda" if cuda_in_use() else "cpu"


def read_pairs(data: MLLMDataSpec, on_bad: Callable | None = None) -> list[PreferenceRecord]:
    """Every pair of ``data``'s sources (preference files, ``preference_sources``)."""
    return [pair for source in data.source_entries()
            for pair in read_preference_records(source.path, source.image_root or data.image_root, on_bad=on_bad,
                                                max_record_bytes=data.max_record_bytes, media_roots=data.media_roots)]


def pairs_dataset(data: MLLMDataSpec, encoder: PairEncoder, build: Callable):
    """``build(encoder, pairs)`` over the pairs of ``data``'s sources; pairs the reader refused are the dataset's
    bad records (stage ``read``), or stop the run under ``data.on_bad_record=error``."""
    refused = []
    pairs = read_pairs(data, refused.append if data.on_bad_record == "skip" else None)
    dataset = build(encoder, pairs)
    for err in refused:
        dataset.bad_records.add_error(err, "read")
    dataset.bad_records.records_read = len(pairs) + len(refused)
    return dataset


def pair_dataset(specs: RunSpecs, spec: PreferenceSpec, encoder, build: Callable, model,
                 announce: Callable[[str], None] = print):
    """The run's dataset over its pairs: ``build(encoder, records)`` (``run.build_run_dataset``) with the recipe's
    encoder wrapped in a :class:`PairEncoder`, the prefix duplicated where ``model`` cannot share it (said through
    ``announce``; the eval pairs and the reference pass then take the same layout)."""
    settle_layout(spec, model, specs.attention, announce)
    return pairs_dataset(specs.data, PairEncoder(encoder, spec.shared_prefix), build)


def settle_layout(spec: PreferenceSpec, model, attention: str, announce: Callable[[str], None] = print) -> None:
    """``dpo.shared_prefix`` off (said through ``announce``) where ``model`` on ``attention`` cannot share it."""
    obstacle = prefix_obstacle(model, attention) if spec.shared_prefix else None
    if obstacle is not None:
        spec.shared_prefix = False
        announce(f"dpo: each pair's prefix duplicated per answer ({obstacle})")


def eval_pairs(spec: PreferenceSpec, encoder) -> Callable:
    """How an eval source (``evaluation.build_eval_sets``: its data spec and ``build(encoder, records)``) becomes a
    dataset of held-out pairs, laid out as the training pairs are."""
    pair_encoder = PairEncoder(encoder, spec.shared_prefix)
    return lambda data, build: pairs_dataset(data, pair_encoder, build)


def build_objective(spec: PreferenceSpec, model, device, sharded: bool = False) -> PreferenceObjective:
    """The step's objective; under ``dpo.reference=copy`` with a frozen copy of ``model`` as it starts, moved to
    ``device``, or left where it is when ``sharded`` (``train.sharding=fsdp2``: ``parallel.shard_frozen`` shards it
    as the policy and moves the shards; a rank that built the model without its weights has nothing to move)."""
    if not (spec.needs_reference and spec.reference == "copy"):
        return PreferenceObjective(spec)
    reference = frozen_copy(model)
    return PreferenceObjective(spec, reference if sharded else reference.to(device))
