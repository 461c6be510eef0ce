"""Evaluation on held-out sources (``data.eval_sources``), inside a run and stand-alone (``evaluate.py``).

Each eval source is encoded, planned and packed by the DataKit like the training set (same packing, its own plan,
record order, nothing dropped without being counted), split over the ranks as training is. Its loss is the
token-weighted mean over the whole source: every rank sums the token losses and the supervised-token counts of its
packs, the sums are reduced, and only then divided, so the number does not depend on how the tokens were packed,
on the world size or on the micro-batch.

No number stands for nothing evaluated: a source whose every record is left out (overlong, bad) stops the run or
the evaluation before any model runs, in one line naming the source and the reasons; where the samples planned all
turn out bad when decoded, the loss is None with its reason (``eval_loss_reason``), never 0.

Under ``train.objective=dpo`` the sources hold held-out preference pairs (``preference.eval_pairs``) and the loss is
the training objective's, weighted per pair: ``eval_loss`` is the mean pair loss over ``eval_pairs`` pairs, beside
the pairs' means of ``preference.METRICS`` (``eval_rewards/chosen``, ``eval_rewards/margin``,
``eval_rewards/accuracy``, ...), each summed over the ranks before it is divided, as the loss is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from mvp_engine.kit.mllm.data import BadRecord, MLLMDataKit, MLLMSampleEncoder, RecordLedger

from .config import ConfigError, RunSpecs
from .parallel import ParallelLayout
from .preference import pair_means
from .train_step import TrainStep

EVAL_LOSS = "eval_loss"
NO_LOSS = "eval_loss_reason"  # beside an eval_loss of None: why nothing was evaluated
NOTHING_DECODED = "no sample was evaluated: every sample planned was a bad record when decoded (see records)"


@dataclass
class EvalSet:
    """One eval source (``name``: the entry's, by default its file stem) and this rank's packs of it."""

    name: str
    dataset: object  # MLLMPackedDataset | MLLMStreamingPackedDataset

    def check_bad_records(self, found_decoding: Iterable[dict] = ()) -> None:
        """``data.on_bad_record`` and ``data.max_bad_fraction`` over this source alone: its bad records (found
        measuring it, and ``found_decoding``, each counted once however often it is evaluated) of its records read.
        Each eval source is held to the fraction on its own, as the training sources are together, rather than
        pooled with them: its loss is reported on its own, and a small held-out set mostly bad must not hide behind
        a large training set (nor fail a run for the training data's faults). Stops with one line naming the
        source."""
        report = self.dataset.bad_records
        for bad in found_decoding:
            report.add(BadRecord(**{key: value for key, value in bad.items() if key != "source"}))
        report.check(None, scope=f"data.eval_sources: {self.name}")

    def check_something_left(self) -> None:
        """A source with no record left to evaluate stops here, naming why, instead of reporting a loss of 0."""
        ledger = self.dataset.epoch_ledger(epoch=0)
        left_out = ledger.dropped + ledger.bad
        if left_out.total() >= ledger.records_read:
            raise ConfigError(f"data.eval_sources: {self.name}: none of its {ledger.records_read} records can be "
                              f"evaluated, by reason {dict(left_out)}: raise data.max_seq_len (overlong), fix the "
                              f"records (bad), or leave the source out")


def build_eval_sets(specs: RunSpecs, encoder: MLLMSampleEncoder, rank: int, world_size: int,
                    pairs: Callable | None = None) -> list[EvalSet]:
    """Every ``data.eval_sources`` entry as a dataset of its own, planned now (measuring every record, so a bad
    record stops or is counted before the first step, as the training set's are). ``pairs``
    (``preference.eval_pairs``): the sources hold preference pairs, ``pairs(data, build)`` reads them."""
    sets = []
    for source in specs.data.eval_source_entries():  # validated: a name is used once
        data = specs.data.eval_spec(source)

        def build(records_encoder, records=None, data=data):
            return MLLMDataKit.build_dataset(data, records_encoder, rank=rank, world_size=world_size,
                                             records=records, micro_batch_size=specs.train.micro_batch_size)

        dataset = build(encoder) if pairs is None else pairs(data, build)
        dataset.plan(0)
        eval_set = EvalSet(source.name, dataset)
        eval_set.check_bad_records()
        eval_set.check_something_left()
        sets.append(eval_set)
    return sets


class Evaluator:
    """The eval loss of a model over the eval sets, on every rank (each rank runs its own packs under
    ``torch.no_grad()``; the sums are reduced).

    ``step`` is the run's ``TrainStep``: its forward and loss are the training ones (the dummy media passes FSDP2's
    gathers need on a text-only micro-batch; under context parallelism this rank's chunk of every row and its
    ``span``, the positions this rank's loss covers; ``train.loss_impl``), with the token reduction. ``layout``
    says which data-parallel rank's packs this rank evaluates and whether it counts their rows (a CP group's rows
    once)."""

    def __init__(self, accelerator: Accelerator, sets: list[EvalSet], collator, step: TrainStep,
                 layout: ParallelLayout, micro_batch_size: int, every_steps: int = 0):
        self.accelerator, self.sets, self.collator, self.step, self.layout = accelerator, sets, collator, step, layout
        self.micro_batch_size, self.every_steps = micro_batch_size, every_steps

    def due(self, step: int) -> bool:
        """``train.eval_every_steps``: after every that many optimizer steps (0: only at the end)."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def _loader(self, eval_set: EvalSet) -> DataLoader:
        eval_set.dataset.set_epoch(0)
        # its own generator: an evaluation must not draw from the global RNG the training continues on
        return DataLoader(eval_set.dataset, batch_size=self.micro_batch_size, collate_fn=self.collator,
                          generator=torch.Generator().manual_seed(0))

    def __call__(self, model, desc: str = "eval") -> tuple[dict, dict]:
        """``(metrics, records)``: ``eval_loss`` (plus ``eval_loss/<name>`` per source when there are several),
        the supervised tokens, samples and packs evaluated; and each source's record ledger (read == evaluated + dropped
        + bad). Every rank must call it."""
        accelerator = self.accelerator
        loaders = [self._loader(s) for s in self.sets]
        # per source: weighted loss sum, supervised tokens (pairs under dpo), samples, packs (rows holding a sample)
        sums = torch.zeros(len(self.sets), 4, dtype=torch.float64)
        objective = self.step.objective  # train.objective=dpo: its rewards, margin, accuracy per source
        pair_totals = []
        found: list[list[dict]] = [[] for _ in self.sets]  # bad records found decoding, per source
        counts_rows = self.layout.counts_rows
        was_training = model.training
        model.eval()
        bar = tqdm(total=sum(len(loader) for loader in loaders), desc=desc, leave=False,
                   disable=not accelerator.is_main_process)
        try:
            with torch.no_grad():
                for index, loader in enumerate(loaders):
                    for batch in loader:
                        bad = batch.pop("bad_records", ())
                        if counts_rows:
                            found[index].extend(bad)
                        batch = send_to_device(batch, accelerator.device)
                        with accelerator.autocast():
                            part, _ = self.step.loss(model, batch, "token")
                        sums[index, 0] += part.weighted_sum.double().cpu()
                        sums[index, 1] += part.weight_total.double().cpu()
                        if counts_rows:
                            sums[index, 2] += int(batch["source_sample_num"].sum())
                            sums[index, 3] += int((batch["source_sample_num"] > 0).sum())
                        bar.update(1)
                    if objective is not None:
                        pair_totals.append(objective.take_totals())
        finally:
            bar.close()
            model.train(was_training)
        sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").cpu()
        every_rank = gather_object([found]) if accelerator.num_processes > 1 else [found]
        found = [[bad for rank in every_rank for bad in rank[index]] for index in range(len(self.sets))]
        for eval_set, bad in zip(self.sets, found):
            eval_set.check_bad_records(bad)  # the same verdict on every rank: all stop together
        faults = [Counter(bad["reason"] for bad in source) for source in found]
        metrics = eval_metrics([s.name for s in self.sets], sums, "tokens" if objective is None else "pairs")
        if objective is not None:
            totals = accelerator.reduce(torch.stack(pair_totals).to(accelerator.device), reduction="sum").cpu()
            metrics.update(pair_eval_metrics([s.name for s in self.sets], totals))
        return metrics, self._records(sums, faults)

    def _records(self, sums: torch.Tensor, faults: list[Counter]) -> dict:
        """Each source's ledger: the plan's drops, the bad records found measuring it and, from every rank, those
        found decoding it."""
        records = {}
        for eval_set, row, fault in zip(self.sets, sums, faults):
            ledger: RecordLedger = eval_set.dataset.epoch_ledger(epoch=0)
            ledger.samples_trained = int(row[2])
            ledger.bad.update(fault)
            entry = ledger.to_dict()
            entry.pop("epoch")
            entry["samples_evaluated"] = entry.pop("samples_trained")
            records[eval_set.name] = entry
        return records


def eval_metrics(names: list[str], sums: torch.Tensor, unit: str = "tokens") -> dict:
    """The metrics of per-source sums (weighted loss, its weight: supervised ``tokens`` or preference ``pairs``,
    samples, packs): a loss is None where nothing was evaluated, with the reason beside the overall one."""
    total = sums.sum(0)
    metrics = {EVAL_LOSS: _mean(total), f"eval_{unit}": int(total[1]), "eval_samples": int(total[2]),
               "eval_packs": int(total[3])}
    if metrics[EVAL_LOSS] is None:
        metrics[NO_LOSS] = NOTHING_DECODED
    if len(names) > 1:
        for name, row in zip(names, sums):
            metrics[f"{EVAL_LOSS}/{name}"] = _mean(row)
    return metrics


def pair_eval_metrics(names: list[str], totals: torch.Tensor) -> dict:
    """``eval_<metric>`` of the pairs of every source (``totals``: per source, the objective's sums over the ranks),
    and ``eval_<metric>/<name>`` per source when there are several; None where no pair was evaluated."""

    def means(row: torch.Tensor, suffix: str = "") -> dict:
        values = pair_means(row)
        return {f"eval_{key}{suffix}": value if row[-1] > 0 else None for key, value in values.items()}

    metrics = means(totals.sum(0))
    if len(names) > 1:
        for name, row in zip(names, totals):
            metrics.update(means(row, f"/{name}"))
    return metrics


def _mean(row: torch.Tensor) -> float | None:
    return float(row[0] / row[1]) if row[1] > 0 else None


def describe(metrics: dict, digits: int = 4) -> str:
    """An evaluation's console line: its loss, or why there is none, and what it covered."""
    loss = metrics[EVAL_LOSS]
    said = f"{EVAL_LOSS} {loss:.{digits}f}" if loss is not None else f"{EVAL_LOSS} none ({metrics[NO_LOSS]})"
    if "eval_pairs" in metrics:  # train.objective=dpo
        margin, accuracy = metrics["eval_rewards/margin"], metrics["eval_rewards/accuracy"]
        if loss is not None:
            said += f", margin {margin:.{digits}f}, accuracy {accuracy:.3f}"
        return f"{said} over {metrics['eval_pairs']} pairs"
    return f"{said} over {metrics['eval_tokens']} tokens of {metrics['eval_samples']} samples"


def build_evaluator(specs: RunSpecs, accelerator: Accelerator, encoder: MLLMSampleEncoder, collator,
                    step: TrainStep, layout: ParallelLayout, pairs: Callable | None = None) -> Evaluator | None:
    """The run's evaluator over ``data.eval_sources`` (None without any); ``pairs``: as for
    :func:`build_eval_sets`."""
    if not specs.data.eval_sources:
        return None
    sets = build_eval_sets(specs, encoder, layout.dp_rank, layout.dp_size, pairs)
    if accelerator.is_main_process:
        for eval_set in sets:
            ledger = eval_set.dataset.epoch_ledger(epoch=0)
            left_out = ledger.dropped + ledger.bad
            if left_out:
                print(f"eval data {eval_set.name}: {left_out.total()} of {ledger.records_read} records left out, by "
                      f"reason {dict(left_out)} (counted in the eval records of summary.json / eval.json)")
    return Evaluator(accelerator, sets, collator, step, layout, specs.train.micro_batch_size,
                     specs.train.eval_every_steps)
