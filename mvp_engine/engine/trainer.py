"""The training loop every recipe shares: accelerate, AdamW, exact loss reductions and honest accounting."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn

import hydra
import torch
from accelerate.utils import gather_object, send_to_device, set_seed
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from mvp_engine.kit.mllm.data import (
    BadRecord,
    BadRecordReport,
    MLLMCollator,
    MLLMDataKit,
    MLLMRecordError,
    RecordLedger,
    TokenAccounting,
    TooManyBadRecords,
)
from mvp_engine.kit.mllm.data.steps import micro_batches_per_rank

from .checkpoint import Checkpointer, RunState, load_run_state, resolve_resume
from .config import CONF_DIR, ConfigError, RunSpecs, data_with_sources, resolve_run_specs
from .flops import batch_flops, device_peak_tflops, recipe_cost_profile
from .launch import build_accelerator, describe_processes, end_processes
from .loss import token_weights, weighted_token_loss
from .participation import dummy_media_loss, freeze_parameters, has_media
from .preemption import PreemptionWatch, ignore_stop_signals
from .recipe import Recipe

BAD_RECORDS = "bad_records.jsonl"
DROPPED_RECORDS = "dropped_records.jsonl"
# metrics.jsonl values that depend on the wall clock: the only ones a rerun (or a resume) may not reproduce
WALL_CLOCK_METRICS = ("tokens_per_s", "tflops_per_s", "mfu", "compute_ms", "barrier_wait_ms")


def step_groups(loader, size: int):
    """Micro-batches grouped per optimizer step; the last group may be short (it still steps)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


class Trainer:
    """Runs one recipe on one validated config; ``run()`` returns the end-of-run summary."""

    def __init__(self, cfg: DictConfig, recipe: Recipe):
        self.recipe = recipe
        self.specs: RunSpecs = resolve_run_specs(cfg, recipe.attention_backends)
        self.cfg = cfg
        train = self.specs.train
        self.accelerator = build_accelerator(train.mixed_precision)
        set_seed(train.seed)
        self.output_dir = Path(train.output_dir or "outputs/run")
        self.resume_from = resolve_resume(train.resume_from, self.output_dir)
        if self.resume_from is not None:
            load_run_state(self.resume_from).check_shape(*self._shape(), source=self.resume_from)
        self.processor = recipe.build_processor(cfg.model)
        self.encoder = recipe.build_encoder(self.processor)
        self.model = recipe.build_model(cfg.model, self.specs.attention)
        self.parameters = freeze_parameters(self.model, cfg.model.get("freeze") or [],
                                            recipe.unreachable_parameters(self.model))
        self.dummy_media = recipe.dummy_media(self.model)
        # FLOPs per unit of work of this model as it trains: the per-step FLOPs and MFU, and packing.balance=compute
        self.cost_profile = recipe_cost_profile(recipe, self.model)
        self.peak_tflops, self.peak_source = device_peak_tflops(train.peak_tflops, train.mixed_precision,
                                                                self.accelerator.device)
        data = data_with_sources(self.specs)
        self.bad_records = BadRecordReport(data.on_bad_record, data.max_bad_fraction)
        self.dataset = MLLMDataKit.build_dataset(data, self.encoder, rank=self.accelerator.process_index,
                                                 world_size=self.accelerator.num_processes,
                                                 drop_last=train.drop_last, bad_records=self.bad_records,
                                                 micro_batch_size=train.micro_batch_size,
                                                 gradient_accumulation_steps=train.gradient_accumulation_steps,
                                                 cost_profile=self.cost_profile)
        self.collator = MLLMCollator(recipe.pad_token_id(self.processor), train.pad_to_multiple_of)
        self.packed = data.packing is not None
        self.prepare = recipe.prepare_packed if self.packed else recipe.prepare_padded
        self.total_steps = self.dataset.estimate_total_steps(train.epochs, train.micro_batch_size,
                                                             train.gradient_accumulation_steps)
        self._report_bad_records_found_before_training()

    @property
    def bad_records_path(self) -> Path:
        return self.output_dir / BAD_RECORDS

    def _report_bad_records_found_before_training(self) -> None:
        """Reading and measuring every record (done above, on every rank alike) found these; list them all and stop
        with one line when there are too many."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        report = self.bad_records
        if self.accelerator.is_main_process:
            report.write(self.bad_records_path)
            if report.count:
                print(f"data: {report.count} of {report.records_read} records are bad and left out "
                      f"({report.fraction():.1%}; data.max_bad_fraction={report.max_fraction}), by reason "
                      f"{dict(report.counts().most_common())}: listed in {self.bad_records_path}")
        report.check(self.bad_records_path)

    def _optimizer_and_schedule(self):
        train = self.specs.train
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=train.learning_rate, weight_decay=train.weight_decay)
        scheduler = get_scheduler(train.lr_scheduler, optimizer,
                                  num_warmup_steps=math.ceil(train.warmup_ratio * self.total_steps),
                                  num_training_steps=max(1, self.total_steps))
        return optimizer, scheduler

    def _epoch_micro_batches(self, epoch: int) -> int:
        train = self.specs.train
        return micro_batches_per_rank(len(self.dataset.plan(epoch).packs), train.micro_batch_size,
                                      self.accelerator.num_processes, train.drop_last)

    def _loader(self, epoch: int, micro_batches_done: int = 0) -> DataLoader:
        self.dataset.set_epoch(epoch)
        train = self.specs.train
        if hasattr(self.dataset, "worker_batch_size"):
            self.dataset.worker_batch_size = train.micro_batch_size
        dataset = self.dataset.starting_at(micro_batches_done * train.micro_batch_size)
        # its own generator: creating the iterator must not draw from the global RNG, or a mid-epoch resume (which
        # creates one more iterator than the uninterrupted run) would continue on another random stream
        return DataLoader(dataset, batch_size=train.micro_batch_size, collate_fn=self.collator,
                          drop_last=train.drop_last, num_workers=train.num_workers,
                          worker_init_fn=ignore_stop_signals if train.num_workers else None,
                          generator=torch.Generator().manual_seed(train.seed * 1_000_003 + epoch))

    def _train_step(self, group: list[dict], model, optimizer,
                    scheduler) -> tuple[float, float, tuple[float, float] | None]:
        """One optimizer step over ``group``; the denominator covers every micro-batch on every rank.

        The scheduler is stepped here, once per optimizer step (it is not handed to ``accelerator.prepare``, whose
        wrapper would step it once per process), so the schedule is the same on 1 rank and on N.

        Under ``train.time_barrier`` the gradients are all-reduced after the last backward instead of during it (DDP
        overlaps its all-reduce with backward, which hides a fast rank's wait inside its backward): this rank's
        compute time (forward and backward of its micro-batches) and its wait at a barrier before the optimizer step
        are returned, in seconds; the update is the same (the mean of the ranks' gradients).
        """
        reduction = self.specs.train.loss_reduction
        timed = self.specs.train.time_barrier
        local = sum(token_weights(b["labels"], b["pack_segment_ids"], reduction).sum() for b in group)
        total = self.accelerator.reduce(torch.as_tensor(local, device=self.accelerator.device, dtype=torch.float64),
                                        reduction="sum")
        denominator = total.clamp(min=1e-12)
        step_loss = 0.0
        compute_start = time.perf_counter()
        for index, batch in enumerate(group):
            batch = send_to_device(batch, self.accelerator.device)
            sync = index == len(group) - 1 and not timed
            context = self.accelerator.no_sync(model) if not sync else nullcontext()
            with context:
                outputs = model(**self.prepare(batch, model, self.specs.attention))
                part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], reduction)
                loss = part.weighted_sum / denominator * self.accelerator.num_processes
                if not has_media(batch):
                    loss = loss + dummy_media_loss(model, self.dummy_media)
                self.accelerator.backward(loss)
            step_loss += float(part.weighted_sum.detach()) / float(denominator)
        timing = self._barrier_and_sync(model, time.perf_counter() - compute_start) if timed else None
        grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.specs.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = float(self.accelerator.reduce(torch.tensor(step_loss, device=self.accelerator.device),
                                                  reduction="sum"))
        return step_loss, float(grad_norm), timing

    def _barrier_and_sync(self, model, compute_seconds: float) -> tuple[float, float]:
        """``train.time_barrier``: wait at an explicit barrier (timed), then average the gradients over the ranks
        (what DDP's all-reduce does), one flat all-reduce."""
        if self.accelerator.num_processes == 1:
            return compute_seconds, 0.0
        start = time.perf_counter()
        torch.distributed.barrier()
        waited = time.perf_counter() - start
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.accelerator.num_processes
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return compute_seconds, waited

    def _batch_flops(self, group: list[dict]) -> tuple[int, int]:
        """Useful and executed FLOPs of this rank's micro-batches (``flops.batch_flops``)."""
        counts = [batch_flops(self.cost_profile, b, self.specs.attention, self.dummy_media, self.packed) for b in group]
        return sum(c.useful for c in counts), sum(c.executed for c in counts)

    def _shape(self) -> tuple[int, int, int]:
        """What decides which packs each rank trains at each step: a resume must keep it."""
        train = self.specs.train
        return self.accelerator.num_processes, train.micro_batch_size, train.gradient_accumulation_steps

    def _start_state(self, checkpointer: Checkpointer) -> RunState:
        if self.resume_from is None:
            world_size, micro_batch_size, accumulation = self._shape()
            return RunState(world_size=world_size, micro_batch_size=micro_batch_size,
                            gradient_accumulation_steps=accumulation)
        state = checkpointer.load(self.resume_from)
        if self.accelerator.is_main_process:
            print(f"resumed from {self.resume_from}: step {state.step}, epoch {state.epoch}, "
                  f"{state.micro_batches_done} micro-batches into it")
        return state

    def _open_metrics(self, state: RunState):
        """``metrics.jsonl`` keeps the lines up to the resumed step (a killed run may have logged past its last
        checkpoint) and is line-buffered, so a kill loses nothing already trained."""
        path = self.output_dir / "metrics.jsonl"
        kept = []
        if state.step and path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= state.step]
        handle = open(path, "w", buffering=1)
        handle.writelines(line + "\n" for line in kept)
        return handle

    def run(self) -> dict:
        train = self.specs.train
        main = self.accelerator.is_main_process
        if main:
            print(f"{describe_processes(self.accelerator)}; attention {self.specs.attention} "
                  f"({'packed' if self.packed else 'unpacked'})")
            print(self.parameters.describe())
        optimizer, scheduler = self._optimizer_and_schedule()
        model, optimizer = self.accelerator.prepare(self.model, optimizer)
        if train.time_barrier and self.accelerator.num_processes > 1 and \
                not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError("train.time_barrier=true needs DDP (torchrun or conf/accelerate/ddp.yaml) or one "
                              f"process; this run is {self.accelerator.distributed_type.value}")
        self.accelerator.register_for_checkpointing(scheduler)
        model.train()
        checkpointer = Checkpointer(self.accelerator, self.output_dir, train.keep_last)
        state = self._start_state(checkpointer)
        totals = state.accounting()
        ledgers = [RecordLedger.from_dict(e) for e in state.epochs]
        local_steps = 0
        session = {"model_flops": 0, "executed_flops": 0, "seconds": 0.0, "compute": [], "wait": []}
        stopped_by = None
        started = time.perf_counter()
        progress = tqdm(total=self.total_steps, initial=state.step, disable=not main, desc=f"{self.recipe.name} train")
        metrics = self._open_metrics(state) if main else nullcontext()
        if main:
            self._reset_dropped_records(state)
        with metrics, PreemptionWatch() as preemption:
            while state.epoch < train.epochs and stopped_by is None:
                epoch = state.epoch
                if state.micro_batches_done == 0:  # drops are counted and listed once, when an epoch starts
                    ledgers.append(self.dataset.epoch_ledger(train.micro_batch_size, epoch))
                    totals.dropped.update(ledgers[-1].dropped)
                    if main:
                        self._list_dropped_records(epoch)
                epoch_micro_batches = self._epoch_micro_batches(epoch)
                for group in step_groups(self._loader(epoch, state.micro_batches_done),
                                         train.gradient_accumulation_steps):
                    # one collective at every step boundary, before the step: a stop signal on any rank, and the
                    # samples decoding faults took out of this step's packs on every rank
                    stopped_by = self._step_boundary(group, preemption, ledgers[-1])
                    if stopped_by:
                        checkpointer.save(state)
                        break
                    step_start = time.perf_counter()
                    lr = scheduler.get_last_lr()[0]  # the rate this step trains at
                    loss, grad_norm, timing = self._train_step(group, model, optimizer, scheduler)
                    seconds = time.perf_counter() - step_start
                    local = sum((TokenAccounting.from_batch(b) for b in group), TokenAccounting())
                    local.model_flops, local.executed_flops = self._batch_flops(group)
                    step_counts = TokenAccounting.from_tensor(self.accelerator.reduce(
                        local.as_tensor().to(self.accelerator.device), reduction="sum").cpu())
                    totals = totals + step_counts
                    ledgers[-1].samples_trained += step_counts.samples
                    local_steps += 1
                    state.record(loss, totals)
                    state.epochs = [ledger.to_dict() for ledger in ledgers]
                    state.advance(len(group), epoch_micro_batches)
                    record = {"step": state.step, "epoch": epoch, "loss": loss, "lr": lr,
                              "grad_norm": grad_norm, "effective_tokens": step_counts.effective,
                              "supervised_tokens": step_counts.supervised, "samples": step_counts.samples,
                              "packs": step_counts.packs, "padding_ratio": step_counts.padding_ratio,
                              "tokens_per_s": step_counts.effective / seconds,
                              "model_tflops": step_counts.model_flops / 1e12,
                              "executed_tflops": step_counts.executed_flops / 1e12,
                              "tflops_per_s": self._per_device(step_counts.model_flops, seconds)}
                    if self.peak_tflops:
                        record["mfu"] = record["tflops_per_s"] / self.peak_tflops
                    session["model_flops"] += step_counts.model_flops
                    session["executed_flops"] += step_counts.executed_flops
                    session["seconds"] += seconds
                    if timing is not None:
                        ranks = self.accelerator.gather(torch.tensor([timing], dtype=torch.float64,
                                                                     device=self.accelerator.device)).cpu()
                        record["compute_ms"] = [round(1e3 * v, 3) for v in ranks[:, 0].tolist()]
                        record["barrier_wait_ms"] = [round(1e3 * v, 3) for v in ranks[:, 1].tolist()]
                        session["compute"].append(record["compute_ms"])
                        session["wait"].append(record["barrier_wait_ms"])
                    if main:
                        self._log_step(metrics, progress, record, step_counts)
                    if train.save_every_steps and state.step % train.save_every_steps == 0:
                        saved = checkpointer.save(state)
                        if main:
                            progress.write(f"checkpoint: {saved}")
        progress.close()
        summary = self._summary(state, totals, ledgers, gather_object([local_steps]), time.perf_counter() - started)
        summary["flops"] = self._flops_summary(totals, session)
        if session["compute"]:
            summary["barrier_timing"] = {
                "steps": len(session["compute"]),
                "compute_ms_per_step": [sum(c) / len(c) for c in zip(*session["compute"])],
                "barrier_wait_ms_per_step": [sum(w) / len(w) for w in zip(*session["wait"])],
            }
        summary["stopped_by"] = stopped_by
        if stopped_by is None:
            self._save(model, summary)
        elif main:
            self._write_summary(summary)
            print(f"stopped by {stopped_by} after step {state.step}; resume with train.resume_from=auto "
                  f"(run directory {self.output_dir})")
        return summary

    def _per_device(self, flops: int, seconds: float) -> float:
        """TFLOP/s of one device: a step's FLOPs over all ranks, per second, per rank."""
        return flops / seconds / self.accelerator.num_processes / 1e12 if seconds else 0.0

    def _flops_summary(self, totals: TokenAccounting, session: dict) -> dict:
        """FLOPs of the whole run (``totals``) and the rate of this session's training steps, with MFU when the
        device's peak is known."""
        rate = self._per_device(session["model_flops"], session["seconds"])
        return {
            "model_tflops": totals.model_flops / 1e12,
            "executed_tflops": totals.executed_flops / 1e12,
            "step_seconds_this_session": session["seconds"],
            "tflops_per_s": rate,
            "executed_tflops_per_s": self._per_device(session["executed_flops"], session["seconds"]),
            "peak_tflops": self.peak_tflops,
            "peak_source": self.peak_source,
            "mfu": rate / self.peak_tflops if self.peak_tflops else None,
            "attention": self.specs.attention,
            "cost_profile": self.cost_profile.to_dict(),
        }

    def _step_boundary(self, group: list[dict], preemption: PreemptionWatch, ledger: RecordLedger) -> str | None:
        """Agree across ranks, before a step: "SIGTERM" when any rank got one; decoding faults of the step's packs
        are gathered, counted and reported, and stop every rank together (one line) under ``on_bad_record=error``
        or past ``data.max_bad_fraction``."""
        local_bad = [bad for batch in group for bad in batch.pop("bad_records", ())]
        flags = torch.tensor([float(preemption.requested), float(len(local_bad))], device=self.accelerator.device)
        stop, bad = self.accelerator.reduce(flags, reduction="sum").tolist()
        if bad:
            found = [BadRecord(**b) for rank_bad in gather_object([local_bad]) for b in rank_bad]
            ledger.bad.update(b.reason for b in found)
            new = [b for b in found if self.bad_records.add(b)]
            if new and self.accelerator.is_main_process:
                self.bad_records.write(self.bad_records_path)
                print(f"left out {len(new)} more bad records found while decoding "
                      f"({dict(Counter(b.reason for b in new))}; first: {new[0].message}): listed in "
                      f"{self.bad_records_path}")
            self.bad_records.check(self.bad_records_path)  # the same verdict on every rank: all stop together
        return "SIGTERM" if stop else None

    def _log_step(self, metrics, progress, record: dict, step_counts: TokenAccounting) -> None:
        metrics.write(json.dumps(record) + "\n")
        progress.update(1)
        progress.set_postfix(loss=f"{record['loss']:.3f}")
        if record["step"] % self.specs.train.log_every == 0:
            progress.write(
                f"step {record['step']}/{self.total_steps} epoch {record['epoch']} loss {record['loss']:.4f} "
                f"lr {record['lr']:.2e} tokens {step_counts.effective} supervised {step_counts.supervised} "
                f"samples {step_counts.samples} padding {step_counts.padding_ratio:.1%} "
                f"tok/s {record['tokens_per_s']:.0f} TFLOP/s {record['tflops_per_s']:.3g}"
                + (f" MFU {record['mfu']:.1%}" if "mfu" in record else ""))

    def _reset_dropped_records(self, state: RunState) -> None:
        """``dropped_records.jsonl`` keeps the epochs the resumed position has already started (a killed run may
        have listed the next one too)."""
        path = self.output_dir / DROPPED_RECORDS
        started = state.epoch + (1 if state.micro_batches_done else 0)
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["epoch"] < started] \
            if state.step and path.is_file() else []
        path.write_text("".join(line + "\n" for line in kept))

    def _list_dropped_records(self, epoch: int) -> None:
        """Append the epoch's dropped records (with reasons) beside the summary: a million ids do not belong
        inline. ``bad_records.jsonl`` is kept current as faults appear."""
        records = self.dataset.records
        dropped = self.dataset.dropped_records(self.specs.train.micro_batch_size, epoch)
        with open(self.output_dir / DROPPED_RECORDS, "a") as handle:
            for index, reason in sorted(dropped.items()):
                handle.write(json.dumps({"epoch": epoch, "origin": records[index].origin,
                                         "record_id": records[index].record_id, "reason": reason}) + "\n")

    def _summary(self, state: RunState, totals: TokenAccounting, ledgers: list[RecordLedger],
                 steps_per_rank: list[int], seconds: float) -> dict:
        losses = state.losses
        report = self.bad_records
        head = losses[: max(1, len(losses) // 10)]
        tail = losses[-max(1, len(losses) // 10):]
        return {
            "recipe": self.recipe.name,
            "packing": None if not self.packed else self.specs.data.packing.strategy,
            "attention": self.specs.attention,
            "world_size": self.accelerator.num_processes,
            "estimated_steps": self.total_steps,
            "actual_steps": state.step,
            "steps_per_rank_this_session": steps_per_rank,
            "resumed_from": None if self.resume_from is None else str(self.resume_from),
            "parameters": self.parameters.to_dict(),
            "seconds": seconds,
            "effective_tokens_per_s": totals.effective / seconds if seconds else 0.0,
            "loss_first": head and sum(head) / len(head),
            "loss_last": tail and sum(tail) / len(tail),
            "losses": losses,
            "totals": totals.to_dict(),
            "records": {"read": report.records_read, "bad": dict(report.counts()), "bad_total": report.count,
                        "bad_fraction": report.fraction(), "bad_records_file": str(self.bad_records_path),
                        "dropped_records_file": str(self.output_dir / DROPPED_RECORDS)},
            "epochs": [ledger.to_dict() for ledger in ledgers],
            "output_dir": str(self.output_dir),
        }

    def _write_summary(self, summary: dict) -> None:
        with open(self.output_dir / "summary.json", "w") as handle:
            json.dump(summary, handle, indent=2)

    def _save(self, model, summary: dict) -> None:
        state_dict = self.accelerator.get_state_dict(model)  # every rank takes part (FSDP gathers shards here)
        if not self.accelerator.is_main_process:
            return
        model_dir = self.output_dir / "model"
        self.accelerator.unwrap_model(model).save_pretrained(model_dir, state_dict=state_dict)
        self.processor.save_pretrained(model_dir)
        self._write_summary(summary)
        print(f"summary: steps {summary['actual_steps']} (estimated {summary['estimated_steps']}), loss "
              f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}, effective tokens/s "
              f"{summary['effective_tokens_per_s']:.0f}, padding {summary['totals']['padding_ratio']:.1%}, "
              f"dropped {summary['totals']['dropped']}; saved to {model_dir}")


def run_recipe(cfg: DictConfig, recipe: Recipe) -> dict:
    """Hydra entry body of every recipe: a bad config or bad data stops the run with one line on stderr naming the
    key or the record, exit status 1; the process group is torn down on every way out."""
    try:
        return Trainer(cfg, recipe).run()
    except ConfigError as err:
        _stop(f"config error: {err}")
    except (MLLMRecordError, TooManyBadRecords) as err:  # while planning, or while decoding (all ranks at one step)
        _stop(f"data error: {err}")
    finally:
        end_processes()


def _stop(line: str) -> NoReturn:
    """Print the run's last line before the process group goes down (``SystemExit(line)`` would print it only
    after: a launcher kills the other ranks as soon as one exits, so a slower rank's line would be lost)."""
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def hydra_main(recipe: Recipe):
    """The ``main()`` of ``recipes/<name>/train.py``: Hydra over ``conf/<name>.yaml``, then :func:`run_recipe`."""

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run_recipe(cfg, recipe)

    return main
