"""The training loop every recipe shares: accelerate, AdamW, exact loss reductions and honest accounting.

A ``Trainer`` is built from a config whose ``data.sources`` are filled (``mvp_engine.engine.demo.with_demo_data``
fills them with the demo set: the entry point calls it); building it writes no file, ``run()`` writes the run
directory (``run_files``), steps with ``train_step.TrainStep``, reports with ``step_metrics`` and checkpoints with
``checkpoint``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from mvp_engine.kit.mllm.data import (
    BadRecord,
    RecordLedger,
    SourceTally,
    TokenAccounting,
    token_shares,
)
from mvp_engine.kit.mllm.data.steps import estimate_total_steps
from mvp_engine.packing.linear_attention import describe_linear_attention

from .checkpoint import Checkpointer, RunState
from .expert_parallel import full_experts, saved_whole
from .flops import batch_flops, device_peak_tflops
from .launch import describe_processes, workers_for
from .lora import save_adapters
from .preemption import PreemptionWatch, ignore_stop_signals
from .recipe import Recipe
from .reference_logps import attach_precomputed_reference
from .run import assemble
from .run_files import RunFiles
from .sharding import describe_sharding, full_state_dict, is_sharded, own_class
from .step_metrics import StepLog, Throughput, barrier_timing_ms, step_record
from .trackers import RunTrackers, run_config
from .train_step import optimizer_and_schedule


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


@dataclass
class Progress:
    """What the loop carries from step to step: the checkpointed position and the live counts it is made of."""

    state: RunState
    totals: TokenAccounting
    ledgers: list[RecordLedger]
    sources: dict[str, SourceTally] = field(default_factory=dict)  # by source name (``summary.json["sources"]``)
    steps_this_session: int = 0
    stopped_by: str | None = None
    effective_before: int = 0  # the effective tokens of the steps a resumed run trained before this session

    @classmethod
    def from_state(cls, state: RunState) -> Progress:
        totals = state.accounting()
        return cls(state, totals, [RecordLedger.from_dict(e) for e in state.epochs],
                   {name: SourceTally.from_dict(values) for name, values in state.sources.items()},
                   effective_before=totals.effective)

    @property
    def effective_this_session(self) -> int:
        return self.totals.effective - self.effective_before

    def start_epoch(self, ledger: RecordLedger, sources: dict[str, SourceTally]) -> None:
        """Drops are counted once, when an epoch starts; so are each source's draws, drops and bad records."""
        self.ledgers.append(ledger)
        self.totals.dropped.update(ledger.dropped)
        for name, tally in sources.items():
            self.sources.setdefault(name, SourceTally()).add_planned(tally)

    def stream_position(self, data: dict, ledger: RecordLedger, tallies: list[SourceTally], names: list[str]) -> None:
        """Stream mode, before a step is recorded: the stream's state after it, and what the stream has read,
        dropped and truncated so far (its one ledger; per source), counted as they happen rather than planned."""
        self.state.data = data
        current = self.ledgers[-1]
        current.records_read, current.dropped, current.truncated = ledger.records_read, ledger.dropped, ledger.truncated
        self.totals.dropped = Counter(ledger.dropped)
        for name, tally in zip(names, tallies, strict=True):
            kept = self.sources.setdefault(name, SourceTally())
            kept.records, kept.dropped = tally.records, tally.dropped

    def record_step(self, loss: float, counts: TokenAccounting, epoch_steps: int,
                    sources: dict[str, list[int]]) -> None:
        """``sources``: the step's samples, effective and supervised tokens per source, summed over ranks."""
        self.totals = self.totals + counts
        self.ledgers[-1].samples_trained += counts.samples
        for name, row in sources.items():  # setdefault: a checkpoint written before per-source tallies has none
            self.sources.setdefault(name, SourceTally()).add_trained(row)
        self.state.sources = {name: tally.to_dict() for name, tally in self.sources.items()}
        self.steps_this_session += 1
        self.state.record(loss, self.totals)
        self.state.epochs = [ledger.to_dict() for ledger in self.ledgers]
        self.state.advance(epoch_steps)


@dataclass
class Session:
    """The objects one ``run()`` trains with."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    checkpointer: Checkpointer
    progress: Progress
    log: StepLog
    preemption: PreemptionWatch
    throughput: Throughput
    evaluation: dict | None = None  # the latest eval result (train.eval_every_steps, the end of the run)


class Trainer:
    """Runs one recipe on one validated config; ``run()`` returns the end-of-run summary. The run's parts are
    assembled by ``run.assemble``; the trainer is the loop over them."""

    def __init__(self, cfg: DictConfig, recipe: Recipe):
        self.recipe, self.cfg = recipe, cfg
        self.parts = parts = assemble(cfg, recipe, "train")
        self.specs, self.accelerator, self.layout = parts.specs, parts.accelerator, parts.layout
        self.processor, self.encoder, self.model = parts.processor, parts.encoder, parts.model
        self.dataset, self.collator, self.train_step = parts.dataset, parts.collator, parts.step
        self.evaluator, self.total_steps = parts.evaluator, parts.total_steps
        self.output_dir, self.resume_from, self.files = parts.output_dir, parts.resume_from, RunFiles(parts.output_dir)
        self.bad_records = self.dataset.bad_records
        self.reference_report: dict | None = None  # dpo.reference=precomputed: what its pass computed or read
        train = self.specs.train
        self.peak_tflops, self.peak_source = device_peak_tflops(train.peak_tflops, train.mixed_precision,
                                                                self.accelerator.device)

    @property
    def bad_records_path(self) -> Path:
        return self.files.bad_records

    @property
    def streaming(self) -> bool:
        return self.specs.data.streaming

    @property
    def _epochs(self) -> int:
        """A stream (``data.streaming``) is one epoch of ``train.max_steps`` steps; indexed data ``train.epochs``."""
        return 1 if self.streaming else self.specs.train.epochs

    # --- the run: start, epochs, finish --------------------------------------------------------------------------

    def run(self) -> dict:
        """Train every epoch (a stop signal checkpoints and ends early), then write the summary and the model."""
        self._report_bad_records_found_before_training()
        # dpo.reference=precomputed: one pass of the model as it starts (before a resume loads its checkpoint)
        self.reference_report = attach_precomputed_reference(self.parts)
        model, optimizer, scheduler = self._prepare_training()
        checkpointer = Checkpointer(self.accelerator, self.output_dir, self.specs.train.keep_last, model, optimizer,
                                    scheduler, trainable_only=self.specs.model.lora.enabled)
        progress = Progress.from_state(self._start_state(checkpointer))
        started = time.perf_counter()
        trackers = RunTrackers(self.accelerator, self.specs.train.report_to, self.output_dir, self.recipe.name,
                               run_config(self.recipe.name, self.specs, self.cfg))
        with self._step_log(progress.state, trackers) as log, PreemptionWatch() as preemption:
            session = Session(model, optimizer, scheduler, checkpointer, progress, log, preemption, Throughput())
            while progress.state.epoch < self._epochs and progress.stopped_by is None:
                self._train_epoch(session)
            if progress.stopped_by is None:
                self._evaluate_at_end(session)
        trackers.end()
        return self._finish(session, time.perf_counter() - started)

    def _report_bad_records_found_before_training(self) -> None:
        """Reading and measuring every record (done when the dataset was built, on every rank alike) found these;
        list them all and stop with one line when there are too many."""
        self.files.make()
        report = self.bad_records
        if self.accelerator.is_main_process:
            report.write(self.bad_records_path)
            if report.count:
                print(f"data: {report.count} of {report.records_read} records are bad and left out "
                      f"({report.fraction():.1%}; data.max_bad_fraction={report.max_fraction}), by reason "
                      f"{dict(report.counts().most_common())}: listed in {self.bad_records_path}")
        report.check(self.bad_records_path)

    def _prepare_training(self):
        """The model (parallelized by the assembly: DDP or FSDP2), its optimizer (prepared by accelerate unless
        sharded: FSDP2's is built over the shards) and the schedule."""
        model = self.model
        if self.accelerator.is_main_process:
            print(f"{describe_processes(self.accelerator)}, data workers {workers_for(self.specs.train.num_workers)}; "
                  f"mixed_precision {self.specs.train.mixed_precision}; "
                  f"attention {self.specs.attention} ({self.specs.attention_why})")
            linear = describe_linear_attention(model, self.accelerator.device.type)  # Qwen3.5's kernel and why
            if linear is not None:
                print(linear)
            print(self.parts.parameters.describe())
            if is_sharded(model):
                print(describe_sharding(model))
            reference = getattr(self.train_step.objective, "reference", None)
            if reference is not None and is_sharded(reference):  # dpo.reference=copy, sharded as the policy is
                print(describe_sharding(reference, "dpo.reference=copy"))
        optimizer, scheduler = optimizer_and_schedule(model, self.specs.train, self.total_steps)
        if not is_sharded(model):
            optimizer = self.accelerator.prepare_optimizer(optimizer)
        model.train()
        return model, optimizer, scheduler

    def _start_state(self, checkpointer: Checkpointer) -> RunState:
        if self.resume_from is None:
            world_size, micro_batch_size, accumulation = self.parts.step_shape
            return RunState(world_size=world_size, micro_batch_size=micro_batch_size,
                            gradient_accumulation_steps=accumulation, identity=self.parts.identity)
        state = checkpointer.load(self.resume_from)
        if self.streaming:  # where the stream is: cursors, buffered keys, RNG (a step count cannot replay a stream)
            self.dataset.load_state_dict(state.data)
        if self.accelerator.is_main_process:
            print(f"resumed from {self.resume_from}: step {state.step}, epoch {state.epoch}, "
                  f"{state.epoch_steps_done} steps into it (saved under world_size {state.world_size} x micro-batch "
                  f"{state.micro_batch_size} x accumulation {state.gradient_accumulation_steps})")
        # the next checkpoint is written under this run's split, with its identity (checked equal, or new to it)
        state.world_size, state.micro_batch_size, state.gradient_accumulation_steps = self.parts.step_shape
        state.identity = self.parts.identity
        return state

    def _step_log(self, state: RunState, trackers: RunTrackers) -> StepLog:
        """The step output from ``state`` on: files (and trackers) on the main process only, a progress bar
        everywhere."""
        main = self.accelerator.is_main_process
        bar = tqdm(total=self.total_steps, initial=state.step, disable=not main, desc=f"{self.recipe.name} train")
        metrics = None
        if main:
            metrics = self.files.open_metrics(state)
            self.files.reset_dropped_records(state)
        return StepLog(metrics, bar, self.total_steps, self.specs.train.log_every, trackers.log)

    def _finish(self, session: Session, seconds: float) -> dict:
        """The summary (every rank takes part in its gathers); the model is saved only when the run completed."""
        progress = session.progress
        summary = self._summary(progress, gather_object([progress.steps_this_session]), seconds)
        summary["flops"] = session.throughput.flops_summary(progress.totals, self.accelerator.num_processes,
                                                            self.peak_tflops, self.peak_source,
                                                            self.specs.attention, self.parts.cost_profile)
        barrier_timing = session.throughput.barrier_summary()
        if barrier_timing is not None:
            summary["barrier_timing"] = barrier_timing
        summary["stopped_by"] = progress.stopped_by
        if session.evaluation is not None:
            summary["eval"] = session.evaluation
        if self.reference_report is not None:  # sources whose reference log-probabilities were computed / read
            summary["dpo_reference"] = self.reference_report
        if progress.stopped_by is None:
            self._save(session.model, summary)
        elif self.accelerator.is_main_process:
            self.files.write_summary(summary)
            print(f"stopped by {progress.stopped_by} after step {progress.state.step}; resume with "
                  f"train.resume_from=auto (run directory {self.output_dir})")
        return summary

    # --- one epoch, one step -------------------------------------------------------------------------------------

    def _train_epoch(self, session: Session) -> None:
        """The rest of the current epoch, step by step, from the position in ``session.progress``."""
        train, progress = self.specs.train, session.progress
        state = progress.state
        epoch = state.epoch
        if state.epoch_steps_done == 0:
            names = [source.name for source in self.dataset.sources]
            progress.start_epoch(self.dataset.epoch_ledger(epoch=epoch),
                                 dict(zip(names, self.dataset.epoch_sources(epoch=epoch))))
            if self.accelerator.is_main_process and not self.streaming:  # a stream's drops are counted as read
                self.files.list_dropped_records(self.dataset, epoch=epoch)
        epoch_steps = self._epoch_steps(epoch)
        if epoch_steps == 0:  # a mixture's draw can leave one epoch without a pack: nothing to train in it
            session.log.note(f"epoch {epoch} has no optimizer step (no pack): skipped")
            state.epoch, state.epoch_steps_done = epoch + 1, 0
            return
        rank_packs_done = state.epoch_steps_done * train.gradient_accumulation_steps * train.micro_batch_size
        for group in step_groups(self._loader(epoch, rank_packs_done), train.gradient_accumulation_steps):
            data_state = self._stream_state(group)
            # one collective at every step boundary, before the step: a stop signal on any rank, and the samples
            # decoding faults took out of this step's packs on every rank
            progress.stopped_by = self._step_boundary(group, session.preemption, progress)
            if progress.stopped_by:
                session.checkpointer.save(state)
                return
            if data_state is not None:  # the checkpoint after this step resumes the stream from there
                progress.stream_position(data_state, *self.dataset.ledger(data_state),
                                         [source.name for source in self.dataset.sources])
            self._step(session, group, epoch, epoch_steps)
            if self.evaluator is not None and self.evaluator.due(state.step):  # before a checkpoint of this step
                self._evaluate(session, epoch)
            if train.save_every_steps and state.step % train.save_every_steps == 0:
                session.log.note(f"checkpoint: {session.checkpointer.save(state)}")
        if state.epoch == epoch:  # the loader ran out before the plan's last step: never loop on an epoch
            raise RuntimeError(f"epoch {epoch} ended after {state.epoch_steps_done} of its {epoch_steps} planned "
                               "optimizer steps: the data loader gave fewer packs than the plan holds")

    def _stream_state(self, group: list[dict]) -> dict | None:
        """Stream mode: the stream's state after this step (on the batch that ends it), and the records read so
        far as the bad-record fraction's denominator. None for indexed data."""
        states = [state for batch in group if (state := batch.pop("data_state", None)) is not None]
        if not states:
            return None
        self.bad_records.records_read = sum(states[-1]["read"])
        return states[-1]

    def _epoch_steps(self, epoch: int) -> int:
        train = self.specs.train
        if self.streaming:
            return self.total_steps
        return estimate_total_steps([len(self.dataset.plan(epoch).packs)], train.micro_batch_size,
                                    train.gradient_accumulation_steps, self.layout.dp_size, train.drop_last)

    def _loader(self, epoch: int, rank_packs_done: int = 0) -> DataLoader:
        """This rank's packs of ``epoch`` from its ``rank_packs_done``-th on: a step count times the packs each rank
        takes per step, which maps one global position to every split of the same global batch."""
        self.dataset.set_epoch(epoch)
        train = self.specs.train
        dataset = self.dataset.starting_at(rank_packs_done)
        workers = workers_for(train.num_workers)
        # its own generator: creating the iterator must not draw from the global RNG, or a mid-epoch resume (which
        # creates one more iterator than the uninterrupted run) would continue on another random stream. On CUDA the
        # batches come in pinned memory, which the step copies to the device without blocking (batch_to_device)
        return DataLoader(dataset, batch_size=train.micro_batch_size, collate_fn=self.collator,
                          drop_last=train.drop_last, num_workers=workers,
                          worker_init_fn=ignore_stop_signals if workers else None,
                          pin_memory=self.accelerator.device.type == "cuda",
                          generator=torch.Generator().manual_seed(train.seed * 1_000_003 + epoch))

    def _step(self, session: Session, group: list[dict], epoch: int, epoch_steps: int) -> None:
        """One optimizer step, its counts summed over ranks, and its record logged."""
        start = time.perf_counter()
        lr = session.scheduler.get_last_lr()[0]  # the rate this step trains at
        loss, grad_norm, timing = self.train_step(group, session.model, session.optimizer, session.scheduler)
        seconds = time.perf_counter() - start
        counts = self._step_counts(group)
        session.progress.record_step(loss, counts, epoch_steps, self._source_counts(group))
        record = step_record(session.progress.state.step, epoch, loss, lr, grad_norm, counts, seconds,
                             self.accelerator.num_processes, self.peak_tflops)
        if self.train_step.balance is not None:  # aux_loss and expert_load, over every rank
            record.update(self.train_step.balance.step_metrics())
        if self.train_step.objective is not None:  # train.objective=dpo: rewards, margin, accuracy over every rank
            record.update(self.train_step.objective.step_metrics(
                lambda totals: self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum")))
        if record["step"] % self.specs.train.log_every == 0:
            record["source_token_shares"] = token_shares(session.progress.sources)
        if timing is not None:
            ranks = self.accelerator.gather(torch.tensor([timing], dtype=torch.float64,
                                                         device=self.accelerator.device)).cpu()
            record.update(barrier_timing_ms(ranks.tolist()))
        session.throughput.add(record, counts, seconds)
        session.log.write(record, counts)

    def _evaluate(self, session: Session, epoch: int, log: bool = True) -> None:
        """The eval loss after this step, on every rank; logged (``metrics.jsonl``, trackers) unless ``log`` is
        False."""
        metrics, records = self.evaluator(session.model, desc=f"{self.recipe.name} eval")
        record = {"step": session.progress.state.step, "epoch": epoch, **metrics}
        session.evaluation = {**record, "records": records}
        if log:
            session.log.write_eval(record)

    def _evaluate_at_end(self, session: Session) -> None:
        """A run with eval sources ends evaluated: at its last step, unless ``eval_every_steps`` already did (in
        this session, or before the checkpoint it resumed from: then again, unlogged, for the summary)."""
        if self.evaluator is None:
            return
        state = session.progress.state
        done_here = session.evaluation is not None and session.evaluation["step"] == state.step
        if not done_here:
            self._evaluate(session, max(0, state.epoch - 1), log=not self.evaluator.due(state.step))

    def _step_counts(self, group: list[dict]) -> TokenAccounting:
        """The step's token accounting and FLOPs (``flops.batch_flops``), summed over every rank."""
        local = sum((TokenAccounting.from_batch(b) for b in group), TokenAccounting())
        parts = self.parts
        flops = [batch_flops(parts.cost_profile, b, self.specs.attention, parts.dummy_media, parts.packed,
                             self.train_step.dummy_passes(b)) for b in group]
        local.model_flops, local.executed_flops = sum(c.useful for c in flops), sum(c.executed for c in flops)
        if not self.layout.counts_rows:  # the rows of a CP group are counted once, by its first rank
            local = TokenAccounting()
        return TokenAccounting.from_tensor(self.accelerator.reduce(local.as_tensor().to(self.accelerator.device),
                                                                   reduction="sum").cpu())

    def _source_counts(self, group: list[dict]) -> dict[str, list[int]]:
        """The step's samples, effective and supervised tokens per source (the batches' ``source_counts``), summed
        over every rank (a CP group's rows once, as ``_step_counts`` counts them), by source name."""
        local = sum(batch["source_counts"] for batch in group)
        if not self.layout.counts_rows:
            local = torch.zeros_like(local)
        rows = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").cpu().tolist()
        return {source.name: row for source, row in zip(self.dataset.sources, rows, strict=True)}

    def _step_boundary(self, group: list[dict], preemption: PreemptionWatch, progress: Progress) -> str | None:
        """Agree across ranks, before a step: the stop signal's name when any rank got one (SIGTERM, SIGINT);
        decoding faults of the step's packs are gathered, counted (in the epoch's ledger and by source) and reported,
        and stop every rank together (one line) under ``on_bad_record=error`` or past ``data.max_bad_fraction``."""
        local_bad = [bad for batch in group for bad in batch.pop("bad_records", ())]
        if not self.layout.counts_rows:  # the CP group's ranks decoded the same packs: its first rank reports them
            local_bad = []
        flags = torch.tensor([float(preemption.requested), float(len(local_bad))], device=self.accelerator.device)
        stop, bad = self.accelerator.reduce(flags, reduction="sum").tolist()
        if bad:
            faults = [b for rank_bad in gather_object([local_bad]) for b in rank_bad]
            for b in faults:
                name = self.dataset.sources[b.pop("source")].name
                progress.sources.setdefault(name, SourceTally()).bad[b["reason"]] += 1
            found = [BadRecord(**b) for b in faults]
            progress.ledgers[-1].bad.update(b.reason for b in found)
            new = [b for b in found if self.bad_records.add(b)]
            if new and self.accelerator.is_main_process:
                self.bad_records.write(self.bad_records_path)
                print(f"left out {len(new)} more bad records found while decoding "
                      f"({dict(Counter(b.reason for b in new))}; first: {new[0].message}): listed in "
                      f"{self.bad_records_path}")
            self.bad_records.check(self.bad_records_path)  # the same verdict on every rank: all stop together
        if not stop:
            return None
        # every rank says the same: the signal a rank received (a SIGTERM sent to one rank names SIGTERM everywhere)
        return next(r for r in gather_object([preemption.reason if preemption.requested else None]) if r)

    # --- the end ---------------------------------------------------------------------------------------------------

    def _summary(self, progress: Progress, steps_per_rank: list[int], seconds: float) -> dict:
        state, totals, report = progress.state, progress.totals, self.bad_records
        losses = state.losses
        head = losses[: max(1, len(losses) // 10)]
        tail = losses[-max(1, len(losses) // 10):]
        return {
            "recipe": self.recipe.name,
            "packing": None if not self.parts.packed else self.specs.data.packing.strategy,
            "attention": self.specs.attention,
            "world_size": self.accelerator.num_processes,
            "context_parallel_size": self.layout.cp_size,
            "sharding": self.specs.train.sharding,
            "activation_checkpointing": self.specs.train.activation_checkpointing,
            "lora": self.specs.model.lora.to_dict() if self.specs.model.lora.enabled else None,
            "estimated_steps": self.total_steps,
            "actual_steps": state.step,
            "steps_per_rank_this_session": steps_per_rank,
            "resumed_from": None if self.resume_from is None else str(self.resume_from),
            "parameters": self.parts.parameters.to_dict(),
            "seconds": seconds,
            # this session's tokens over this session's seconds: a resumed run's earlier steps were not timed here
            "effective_tokens_per_s": progress.effective_this_session / seconds if seconds else 0.0,
            "loss_first": head and sum(head) / len(head),
            "loss_last": tail and sum(tail) / len(tail),
            "losses": losses,
            "totals": totals.to_dict(),
            "records": {"read": report.records_read, "bad": dict(report.counts()), "bad_total": report.count,
                        "bad_fraction": report.fraction(), "bad_records_file": str(self.bad_records_path),
                        "dropped_records_file": str(self.files.dropped_records)},
            "epochs": [ledger.to_dict() for ledger in progress.ledgers],
            "sources": {name: tally.to_dict() for name, tally in progress.sources.items()},
            "output_dir": str(self.output_dir),
        }

    def _save(self, model, summary: dict) -> None:
        # every rank takes part: FSDP2 gathers the shards to rank 0, on its CPU
        state_dict = full_state_dict(model) if is_sharded(model) else self.accelerator.get_state_dict(model)
        state_dict.update(full_experts(self.accelerator.unwrap_model(model)))  # gathered over EP groups, if split
        if not self.accelerator.is_main_process:
            return
        model_dir = self.output_dir / "model"
        with self.files.written_aside(model_dir) as partial:
            lora = self.specs.model.lora
            if lora.enabled:  # the adapter folder (and model/merged), from the gathered state dict
                saved = save_adapters(lambda: self.recipe.build_model(self.cfg.model, self.specs.attention), lora,
                                      state_dict, partial)
            else:
                with own_class(self.accelerator.unwrap_model(model)) as unwrapped, saved_whole(unwrapped, state_dict):
                    unwrapped.save_pretrained(partial, state_dict=state_dict)
                saved = [partial]
            for directory in saved:
                self.processor.save_pretrained(directory)
        self.files.write_summary(summary)
        print(f"summary: steps {summary['actual_steps']} (estimated {summary['estimated_steps']}), loss "
              f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}, effective tokens/s "
              f"{summary['effective_tokens_per_s']:.0f}, padding {summary['totals']['padding_ratio']:.1%}, "
              f"dropped {summary['totals']['dropped']}; saved to {model_dir}")

