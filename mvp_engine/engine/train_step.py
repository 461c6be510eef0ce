"""One optimizer step, the one the trainer runs and ``tools/bench_train.py`` times: exact loss normalisation over
every micro-batch on every rank, every parameter in every backward, clipping, the optimizer and the schedule."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from transformers import get_scheduler

from mvp_engine.kit.mllm.data.media import IMAGES, MediaKind
from mvp_engine.packing import SequenceShard

from .config import TrainSpec
from .grad_buckets import all_reduce_mean
from .host_optimizer import HostAdamW
from .linear_loss import HeadInputs
from .loss import WeightedTokenLoss, token_weights, weighted_token_loss
from .parallel import sequence_parallel_forward
from .participation import dummy_passes, forward_with_media_pass
from .router_balance import RouterBalance
from .sharding import clip_grad_norm_, is_sharded


def optimizer_and_schedule(model, train: TrainSpec, total_steps: int):
    """AdamW over the trainable parameters (its state and update on the host under ``train.offload=optimizer``:
    ``host_optimizer.py``) and the configured schedule over ``total_steps`` optimizer steps."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw = HostAdamW if train.offload == "optimizer" else torch.optim.AdamW
    optimizer = adamw(trainable, lr=train.learning_rate, weight_decay=train.weight_decay)
    scheduler = get_scheduler(train.lr_scheduler, optimizer,
                              num_warmup_steps=math.ceil(train.warmup_ratio * total_steps),
                              num_training_steps=max(1, total_steps))
    return optimizer, scheduler


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` on ``device``; on CUDA without blocking: the run's loader pins its batches there (``pin_memory``),
    so the copies run while the host prepares the step instead of draining the GPU's queue first."""
    return send_to_device(batch, device, non_blocking=device.type == "cuda")


@dataclass(frozen=True)
class TrainStep:
    """The step of one run: how its batches become model kwargs (``prepare``, ``attention``), the dummy media passes
    of a micro-batch missing some of the model's ``media_kinds``, and the ``train`` settings it reduces and clips
    with."""

    accelerator: Accelerator
    prepare: Callable[[dict, object, str], dict]
    attention: str
    dummy_media: dict
    train: TrainSpec
    media_kinds: tuple[MediaKind, ...] = (IMAGES,)
    shard: SequenceShard | None = None  # context parallelism: this rank's chunk of every row (parallel.py)
    balance: RouterBalance | None = None  # mixture-of-experts router statistics and load balancing (router_balance.py)
    objective: Any = None  # train.objective=dpo: preference.PreferenceObjective (its loss and weights replace SFT's)

    def span(self, batch: dict) -> tuple[int, int] | None:
        """The positions of the rows this rank computes the loss of (None: all of them)."""
        return None if self.shard is None else self.shard.span(batch["input_ids"].shape[-1])

    def forward_autocast(self, model):
        """The autocast ``model``'s own forward runs under, for the media passes that run before it: accelerate's
        where it prepared the model (DDP, one process: it wraps ``forward`` in its autocast), none for an FSDP2
        root (its mixed-precision policy casts the parameters instead; an outer autocast, as evaluation's, holds)."""
        return nullcontext if is_sharded(model) else self.accelerator.autocast

    def dummy_passes(self, batch: dict) -> int:
        """The dummy media passes ``batch`` needs (``participation.dummy_passes``): one per media encoder it leaves
        unused, or under FSDP2 one per media kind it holds none of, since there every pass of the encoder gathers
        its blocks (a collective) and every rank must run it as often."""
        return dummy_passes(batch, self.media_kinds, per_kind=self.train.sharding == "fsdp2")

    def forward(self, model, batch: dict):
        """The model's outputs on ``batch`` (this rank's chunk under context parallelism) and the zero loss of
        any dummy media passes."""
        kwargs, passes = self.prepare(batch, model, self.attention), self.dummy_passes(batch)
        autocast = self.forward_autocast(model)
        if self.shard is None:
            return forward_with_media_pass(model, kwargs, self.dummy_media, passes, autocast=autocast)
        return sequence_parallel_forward(model, kwargs, self.shard, self.media_kinds, self.dummy_media, passes,
                                         autocast)

    def real_tokens(self, batch: dict) -> torch.Tensor:
        """``[B, L]`` (this rank's chunk of the rows under context parallelism): True on the tokens of a sample,
        False on padding, whose routing the load balancing never counts."""
        real, span = batch["pack_segment_ids"] >= 0, self.span(batch)
        return real if span is None else real[:, span[0]:span[1]]

    def count_forward(self, model, batch: dict) -> None:
        """A forward for its routing alone (``RouterBalance.begin_step``): under the chunked loss the head projects
        one position per row (``HeadInputs``), not the whole logits."""
        batch = batch_to_device(batch, self.accelerator.device)
        if self.train.loss_impl == "full":
            self.forward(model, batch)
            return
        with HeadInputs(model):
            self.forward(model, batch)

    def loss(self, model, batch: dict, reduction: str) -> tuple[WeightedTokenLoss, torch.Tensor | None]:
        """``batch``'s loss parts by ``train.loss_impl`` (``chunked``: the model's head over the hidden states of the
        supervised positions, ``linear_loss.py``; ``full``: its logits) and the zero loss of any dummy media passes.
        The chunked head runs under the forward's autocast, so it projects in the precision the model's own did."""
        if self.objective is not None:
            return self.objective.loss(model, batch, self.forward, self.forward_autocast(model),
                                       self.train.loss_chunk_tokens)
        labels, segments, span = batch["labels"], batch["pack_segment_ids"], self.span(batch)
        if self.train.loss_impl == "full":
            outputs, dummy = self.forward(model, batch)
            return weighted_token_loss(outputs.logits, labels, segments, reduction, span), dummy
        with HeadInputs(model, self.train.loss_impl) as head:
            outputs, dummy = self.forward(model, batch)
        with self.forward_autocast(model)():
            return head.loss(outputs.logits, labels, segments, reduction, span, self.train.loss_chunk_tokens), dummy

    def __call__(self, group: list[dict], model, optimizer,
                 scheduler) -> tuple[float, float, tuple[float, float] | None]:
        """One optimizer step over ``group``; the denominator covers every micro-batch on every rank. Returns the
        step's loss, the gradient norm and, under ``train.time_barrier``, this rank's (compute, wait) seconds.

        The scheduler is stepped here, once per optimizer step (it is not handed to ``accelerator.prepare``, whose
        wrapper would step it once per process), so the schedule is the same on 1 rank and on N.

        Under ``train.time_barrier`` the gradients are all-reduced after the last backward instead of during it (DDP
        overlaps its all-reduce with backward, which hides a fast rank's wait inside its backward): this rank's
        compute time (forward and backward of its micro-batches) and its wait at a barrier before the optimizer step
        are returned; the update is the same (the mean of the ranks' gradients).
        """
        accelerator, reduction, timed = self.accelerator, self.train.loss_reduction, self.train.time_barrier
        local = sum(self.objective.weights(b) if self.objective is not None  # preference pairs (train.objective)
                    else token_weights(b["labels"], b["pack_segment_ids"], reduction, self.span(b)).sum()
                    for b in group)
        total = accelerator.reduce(torch.as_tensor(local, device=accelerator.device, dtype=torch.float64),
                                   reduction="sum")
        denominator = total.clamp(min=1e-12)
        # summed on the device (float64, as the denominator) and read once, after the optimizer step: a float() per
        # micro-batch would make the host wait for each backward
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        compute_start = time.perf_counter()
        sharded = is_sharded(model)
        balance = self.balance
        if balance is not None:  # train.router_aux_loss_scope=step: the step's routing counted first
            balance.begin_step(group, self.real_tokens, lambda b: self.count_forward(model, b), accelerator.device)
        for index, batch in enumerate(group):
            batch = batch_to_device(batch, accelerator.device)
            last = index == len(group) - 1
            if sharded and self.train.grad_sync == "last":
                # the unsharded gradients accumulate (in fp32) until the last micro-batch reduce-scatters them
                model.set_requires_gradient_sync(last)
            # FSDP2 reduce-scatters after every micro-batch under grad_sync=every (the sharded gradients
            # accumulate): the mean over ranks of a sum over micro-batches, as DDP's one sync gives
            sync = sharded or last and not timed
            context = accelerator.no_sync(model) if not sync else nullcontext()
            with context:
                with balance.recording(self.real_tokens(batch)) if balance is not None else nullcontext():
                    part, dummy = self.loss(model, batch, reduction)
                loss = part.weighted_sum / denominator * accelerator.num_processes
                aux = balance.micro_batch_loss(len(group)) if balance is not None else None
                if aux is not None:  # this rank's share of coef x the step's load-balancing loss
                    loss = loss + aux * accelerator.num_processes
                if dummy is not None:
                    loss = loss + dummy
                accelerator.backward(loss)
            step_loss += part.weighted_sum.detach().to(torch.float64) / denominator
        timing = self._barrier_and_sync(model, time.perf_counter() - compute_start) if timed else None
        accelerator.unscale_gradients()  # fp16's loss scale (nothing otherwise)
        grad_norm = clip_grad_norm_(model.parameters(), self.train.max_grad_norm)  # float64, sharded or not
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if balance is not None:  # the step's router sums settled over the ranks; correction biases moved
            balance.end_step()
        step_loss = float(accelerator.reduce(step_loss.to(torch.float32), reduction="sum"))
        return step_loss, float(grad_norm), timing

    def _barrier_and_sync(self, model, compute_seconds: float) -> tuple[float, float]:
        """``train.time_barrier``: wait at an explicit barrier (timed), then average the gradients over the ranks
        (what DDP's all-reduce does), a bucket at a time (``grad_buckets``: one bucket of extra memory)."""
        world_size = self.accelerator.num_processes
        if world_size == 1:
            return compute_seconds, 0.0
        start = time.perf_counter()
        torch.distributed.barrier()
        waited = time.perf_counter() - start
        all_reduce_mean([p.grad for p in model.parameters() if p.grad is not None], world_size)
        return compute_seconds, waited
