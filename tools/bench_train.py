"""Training throughput of packing against the strongest padded baselines: effective tokens/s at several L.

Why: packing is worth its complexity only if it trains more real tokens per second than what a user would run
without it. Random padded batches flatter it; Hugging Face's ``group_by_length`` and token-budget batching pad far
less. And a packed run on its own attention kernel wins twice, once by packing and once by the kernel: (c') below
takes the kernel's share out.

Modes, on the same encoded samples (the demo's fixed-seed LLaVA-like mix), the same initial weights and the same
optimizer settings, one epoch each, at every ``--lengths`` L (``data.max_seq_len`` = packing ``max_seq_len`` = L):

- (a) ``random``: padded batches of ``--micro-batch`` samples in a seeded random order.
- (b) ``group_by_length``: the same batch size in the order of transformers' own ``get_length_grouped_indices``
  (what its ``LengthGroupedSampler`` uses: megabatches of 50 x batch size sorted by length, the longest batch
  first; transformers picks fewer megabatches only on a data set smaller than 200 batches, which would pad more).
- (c) ``token_budget``: samples sorted by length, longest first; each batch takes as many as fit rows x longest <=
  the token budget; batch order shuffled with the seed.
- (a)-(c) run as a padded transformers run does: the recipe's ``prepare_padded`` (a 2-D padding mask) on sdpa.
- (c') ``token_budget_varlen``: (c)'s batches through the recipe's ``prepare_packed`` on sdpa_varlen: each row one
  segment and its padding a segment of its own, so attention does no mask work on padding. Packed modes against
  (c') measure what packing gains with the kernel held equal.
- ``<strategy>/<backend>``: the plan a training run with ``+packing=<strategy>`` (greedy and bfd) and micro-batches of
  R packs makes: the dataset ``mvp_engine.engine.run_data.build_run_dataset`` builds, planned by ``dataset.plan(0)``
  (admission, the epoch's shuffled record order, the strategy), each rank's packs cut into micro-batches as the
  trainer's DataLoader cuts them; through ``prepare_packed`` on each of ``--packed-backends``.

Token budget per micro-batch: R x L tokens, R = round(mean slots of (a)'s micro-batches / L), at least 1, so (a),
(c), (c') and the packed modes see about the same number of token slots per forward; (b) keeps (a)'s batch size in
samples, as a group_by_length user does. Every mode trains with gradient accumulation 1.

What is timed, per micro-batch: the trainer's own step (``mvp_engine.engine.train_step.TrainStep``, accumulation 1,
one process): the loss denominator, the recipe's prepare hook + forward + the loss (``train.loss_reduction``) + the
zero-weighted dummy media pass on a micro-batch without images + backward + gradient clipping + AdamW and scheduler
step. Encoding, planning and collation (``dataset.encode_pack`` + ``MLLMCollator``, as training builds a batch)
happen outside the timer (a real run does them in DataLoader workers), the same work in every mode. Effective
tokens are the non-padding tokens.

Fairness, and why each choice:

- Same samples: the recipe's encoder runs once per record (every dataset below measures and encodes from that);
  at each L the unpacked run's plan (``data.overlong=drop``) leaves out samples longer than L, and every mode
  trains each remaining sample exactly once; the tool stops when the modes' sample sets or effective token counts
  differ.
- Same init: one model per attention backend from the recipe's seeded ``build_model``; every epoch first loads the
  same initial state dict and starts a fresh AdamW and schedule with the config's ``train`` settings.
- Noise: at each L one untimed micro-batch of every mode pays one-off costs, then the modes run interleaved for
  ``--repeats`` rounds and each keeps its fastest epoch (the one least disturbed by other processes). ``--threads``
  (default 1) fixes torch's intra-op threads: with two OpenMP threads on two cores shared with other processes,
  every parallel region waits for a descheduled thread and steps became 10-20x slower at random (measured).
- Nothing is tuned per mode: batch sizes follow from ``--micro-batch`` and the rule above.

Targets, for ``bfd`` on the default packed backend (``attention=auto`` for packed runs on this machine: sdpa_varlen
on CPU), each printed with its measured value and OK/MISS: at L >= 2048, >= 1.10x (c) and >= 1.5x (b); at smaller
L, >= 1.0x (c); at every L, >= 1.0x (c').

    python tools/bench_train.py [--recipe qwen2_vl] [--samples 300] [--lengths 1024 2048 4096]
        [--micro-batch 16] [--packed-backends sdpa_varlen sdpa] [--repeats 2] [--threads 1] [--seed 0]

``main(argv)`` returns what it printed as a dict (used by ``tests/test_bench_train.py``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from transformers.trainer_pt_utils import get_length_grouped_indices

from mvp_engine.engine.config import AUTO_ATTENTION, RunSpecs, compose_config, resolve_attention, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.launch import build_accelerator
from mvp_engine.engine.participation import freeze_parameters, media_kinds
from mvp_engine.engine.plan_report import micro_batches, rank_rows
from mvp_engine.engine.recipe import Recipe, load_recipe
from mvp_engine.engine.run_data import build_run_dataset
from mvp_engine.engine.train_step import TrainStep, optimizer_and_schedule
from mvp_engine.kit.mllm.data import MLLMCollator, MLLMDataKit, MLLMRecord, MLLMSample, SampleMeta
from mvp_engine.packing import SDPA_VARLEN

DEFAULT_LENGTHS = (1024, 2048, 4096)
PADDED_ATTENTION = "sdpa"  # what a padded transformers run uses on CPU
HF_MEGA_BATCH_MULT = 50  # transformers' megabatch multiple on any data set of at least 200 batches
STRATEGIES = ("greedy", "bfd")
TARGET_STRATEGY = "bfd"

RANDOM, GROUPED, BUDGET, BUDGET_VARLEN = "random", "group_by_length", "token_budget", "token_budget_varlen"
BASELINES = (RANDOM, GROUPED, BUDGET, BUDGET_VARLEN)
LABELS = {RANDOM: "(a)", GROUPED: "(b)", BUDGET: "(c)", BUDGET_VARLEN: "(c')"}
LONG_FROM = 2048  # the L from which the stronger targets apply
TARGETS_LONG = ((BUDGET, 1.10), (GROUPED, 1.5), (BUDGET_VARLEN, 1.0))
TARGETS_SHORT = ((BUDGET, 1.0), (BUDGET_VARLEN, 1.0))


# ------------------------------------------------------------------------------------------------------ batching


@dataclass
class Mode:
    """One way of batching the same samples: micro-batches of rows of record indices, the dataset that encodes a
    row (the unpacked run's for the padded baselines, the strategy's for packed modes), and how they are run."""

    name: str
    attention: str
    packed_call: bool  # prepare_packed (segments from pack_segment_ids) or prepare_padded (a 2-D padding mask)
    batches: list[list[list[int]]]
    dataset: object = field(repr=False)

    @property
    def label(self) -> str:
        return LABELS.get(self.name, "packed")


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def random_batches(count: int, batch_size: int, seed: int) -> list[list[int]]:
    """A seeded random order cut into batches, as a shuffling sampler and a DataLoader give."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return chunks(order, batch_size)


def group_by_length_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """transformers' ``LengthGroupedSampler`` order (its own function) cut into batches, as its Trainer does."""
    order = get_length_grouped_indices(lengths, batch_size, mega_batch_mult=HF_MEGA_BATCH_MULT,
                                       generator=torch.Generator().manual_seed(seed))
    return chunks(order, batch_size)


def token_budget_batches(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Longest first, each batch growing while its rows x its first (longest) sample fit ``budget``; the batch
    order is shuffled so long batches do not all come first."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return [batches[j] for j in np.random.default_rng(seed).permutation(len(batches)).tolist()]


def budget_rows(random: list[list[int]], lengths: list[int], length: int) -> int:
    """Packed rows per micro-batch: as many L-token rows as (a)'s mean micro-batch has slots (rows x longest)."""
    slots = [len(batch) * max(lengths[i] for i in batch) for batch in random]
    return max(1, round(sum(slots) / len(slots) / length))


def one_per_row(batches: list[list[int]], records: list[int]) -> list[list[list[int]]]:
    """Batches of positions in ``records`` as micro-batches of one-record rows."""
    return [[[records[j]] for j in batch] for batch in batches]


# ------------------------------------------------------------------------------------------------ config and data


class EncodedOnce:
    """The recipe's encoder run once per record: every dataset of the bench measures and encodes from its samples
    (``measure`` is the sample's own ``meta``, which the encoder contract makes equal to its ``measure``)."""

    def __init__(self, records: list[MLLMRecord], encoder):
        self.samples = {record.origin: encoder.encode(record) for record in records}

    def measure(self, record: MLLMRecord) -> SampleMeta:
        return self.samples[record.origin].meta

    def encode(self, record: MLLMRecord) -> MLLMSample:
        return self.samples[record.origin]


@dataclass
class BenchData:
    """The demo records, read once, their encoder and each record's encoded length."""

    records: list[MLLMRecord]
    encoder: EncodedOnce
    lengths: list[int]


def run_config(args: argparse.Namespace, workdir: Path, length: int, strategy: str | None = None,
               rows: int | None = None) -> DictConfig:
    """The config of a training run at ``data.max_seq_len=length`` (with ``+packing=strategy`` and micro-batches
    of ``rows``), its sources filled with the demo set."""
    overrides = [f"demo.num_samples={args.samples}", f"demo.out_dir={workdir / 'demo'}", f"data.seed={args.seed}",
                 f"train.seed={args.seed}", f"data.max_seq_len={length}", f"model.seed={args.seed}"]
    overrides += [] if strategy is None else [f"+packing={strategy}"]
    overrides += [] if rows is None else [f"train.micro_batch_size={rows}", "train.gradient_accumulation_steps=1"]
    return with_demo_data(compose_config(args.recipe, overrides))


def run_specs(args: argparse.Namespace, recipe: Recipe, workdir: Path, length: int, strategy: str | None = None,
              rows: int | None = None) -> RunSpecs:
    """That run's validated specs: its data admission and packing spec, its train settings."""
    return resolve_run_specs(run_config(args, workdir, length, strategy, rows), recipe.attention_backends)


def read_data(specs: RunSpecs, recipe: Recipe, processor) -> BenchData:
    """Every demo record, read as the DataKit reads it and encoded once by the recipe's encoder."""
    records = MLLMDataKit.read_records(specs.data)
    encoder = EncodedOnce(records, recipe.build_encoder(processor))
    return BenchData(records, encoder, [encoder.encode(record).length for record in records])


def run_dataset(specs: RunSpecs, data: BenchData):
    """The dataset the run of ``specs`` trains on (one process), over the bench's records."""
    return build_run_dataset(specs, data.encoder, None, records=data.records)


def build_modes(args, recipe: Recipe, workdir: Path, length: int, data: BenchData,
                default_backend: str) -> tuple[list[Mode], list[int], int]:
    """Every mode's micro-batches at L = ``length``, the records the unpacked run admits, and the packed rows R."""
    unpacked = run_dataset(run_specs(args, recipe, workdir, length), data)
    admitted = sorted(i for pack in unpacked.plan(0).packs for i in pack)
    lengths = [data.lengths[i] for i in admitted]
    random = random_batches(len(admitted), args.micro_batch, args.seed)
    rows = budget_rows(random, lengths, length)
    budget = one_per_row(token_budget_batches(lengths, rows * length, args.seed), admitted)
    modes = [Mode(RANDOM, PADDED_ATTENTION, False, one_per_row(random, admitted), unpacked),
             Mode(GROUPED, PADDED_ATTENTION, False,
                  one_per_row(group_by_length_batches(lengths, args.micro_batch, args.seed), admitted), unpacked),
             Mode(BUDGET, PADDED_ATTENTION, False, budget, unpacked),
             Mode(BUDGET_VARLEN, SDPA_VARLEN, True, budget, unpacked)]
    for strategy in STRATEGIES:
        specs = run_specs(args, recipe, workdir, length, strategy, rows)
        dataset = run_dataset(specs, data)
        batches = micro_batches(rank_rows(dataset, 0, 0), specs.train.micro_batch_size, specs.train.drop_last)
        modes += [Mode(f"{strategy}/{backend}", backend, True, batches, dataset)
                  for backend in packed_backends(args, default_backend)]
    return modes, admitted, rows


def packed_backends(args: argparse.Namespace, default_backend: str) -> list[str]:
    """``--packed-backends`` with the default backend first (the targets need it)."""
    return list(dict.fromkeys([default_backend, *args.packed_backends]))


def check_same_samples(modes: list[Mode], admitted: list[int]) -> None:
    """Every mode must train each admitted sample exactly once, or the comparison means nothing."""
    for mode in modes:
        trained = sorted(i for batch in mode.batches for row in batch for i in row)
        if trained != admitted:
            raise SystemExit(f"{mode.name} does not train each of the {len(admitted)} admitted samples exactly once")


# ------------------------------------------------------------------------------------------------------ training


@dataclass
class Harness:
    """One model per attention backend, all loaded with ``initial`` before each epoch, and the step settings."""

    recipe: Recipe
    specs: RunSpecs
    collator: MLLMCollator
    accelerator: object
    models: dict = field(default_factory=dict)
    initial: dict = field(default_factory=dict)
    dummy_media: dict = field(default_factory=dict)


def build_harness(recipe: Recipe, specs: RunSpecs, processor, cfg_model, backends: list[str]) -> Harness:
    harness = Harness(recipe, specs, MLLMCollator(recipe.pad_token_id(processor), specs.train.pad_to_multiple_of),
                      build_accelerator(specs.train.mixed_precision))
    for backend in backends:
        model = recipe.build_model(cfg_model, backend)
        freeze_parameters(model, cfg_model.get("freeze") or [], recipe.unreachable_parameters(model))
        harness.models[backend] = model.train()
    first = harness.models[backends[0]]
    harness.initial = {key: value.detach().clone() for key, value in first.state_dict().items()}
    harness.dummy_media = recipe.dummy_media(first)
    return harness


def collate(harness: Harness, mode: Mode, rows: list[list[int]]) -> dict:
    """One micro-batch as training builds it: the mode's dataset encodes each row's pack, the collator pads them
    and, for a packed call, adds the packed metadata the run's collator computes (``Recipe.packed_metadata``,
    outside the timed step as in the run's loader workers); the batch-only ``bad_records`` leave before the step,
    as the trainer's step boundary takes them."""
    batch = harness.collator([mode.dataset.encode_pack(row) for row in rows])
    batch.pop("bad_records")
    if mode.packed_call:
        batch.update(harness.recipe.packed_metadata(harness.models[mode.attention])(batch))
    return batch


def run_epoch(harness: Harness, mode: Mode, batches: list[list[list[int]]]) -> dict:
    """Train ``batches`` from the initial weights with the trainer's step; step seconds and the token accounting
    of what was trained."""
    model = harness.models[mode.attention]
    model.load_state_dict(harness.initial)
    recipe, train = harness.recipe, harness.specs.train
    optimizer, scheduler = optimizer_and_schedule(model, train, len(batches))
    step = TrainStep(harness.accelerator, recipe.prepare_packed if mode.packed_call else recipe.prepare_padded,
                     mode.attention, harness.dummy_media, train, media_kinds(model))
    seconds, effective, slots, trained = 0.0, 0, 0, 0
    for rows in batches:
        batch = collate(harness, mode, rows)
        start = time.perf_counter()
        step([batch], model, optimizer, scheduler)
        seconds += time.perf_counter() - start
        effective += int((batch["pack_segment_ids"] >= 0).sum())
        slots += batch["pack_segment_ids"].numel()
        trained += int(batch["source_sample_num"].sum())
    return {"seconds": seconds, "effective_tokens": effective, "slots": slots, "samples": trained}


def measure_length(args, harness: Harness, workdir: Path, length: int, data: BenchData,
                   default_backend: str) -> dict:
    """All modes at one L: admission, batches, one untimed micro-batch each, then the interleaved timed rounds."""
    modes, admitted, rows = build_modes(args, harness.recipe, workdir, length, data, default_backend)
    check_same_samples(modes, admitted)
    for mode in modes:
        run_epoch(harness, mode, mode.batches[:1])
    best: dict[str, dict] = {}
    for round_index in range(args.repeats):
        for mode in modes:
            progress(f"L={length} round {round_index + 1}/{args.repeats}: {mode.name} ...")
            result = run_epoch(harness, mode, mode.batches)
            if mode.name not in best or result["seconds"] < best[mode.name]["seconds"]:
                best[mode.name] = result
    results = [mode_result(mode, best[mode.name]) for mode in modes]
    if len({(r["samples"], r["effective_tokens"]) for r in results}) != 1:
        raise SystemExit(f"modes trained different data at L={length}: "
                         f"{[(r['mode'], r['samples'], r['effective_tokens']) for r in results]}")
    return {"length": length, "admitted": len(admitted), "dropped": len(data.records) - len(admitted),
            "rows": rows, "budget": rows * length, "admitted_records": admitted, "record_lengths": data.lengths,
            "results": results, "ratios": ratios(results)}


def mode_result(mode: Mode, run: dict) -> dict:
    return {"mode": mode.name, "label": mode.label, "attention": mode.attention,
            "call": "prepare_packed" if mode.packed_call else "prepare_padded", "batches": mode.batches,
            "steps": len(mode.batches), "rows_per_step": sum(map(len, mode.batches)) / len(mode.batches), **run,
            "padding_ratio": 1 - run["effective_tokens"] / run["slots"],
            "tokens_per_s": run["effective_tokens"] / run["seconds"]}


def ratios(results: list[dict]) -> dict[str, dict[str, float]]:
    """Effective tokens/s of every packed mode over each baseline's."""
    rate = {r["mode"]: r["tokens_per_s"] for r in results}
    return {r["mode"]: {base: r["tokens_per_s"] / rate[base] for base in BASELINES}
            for r in results if r["mode"] not in BASELINES}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------------- report


def targets(measured: dict, target_mode: str) -> list[dict]:
    """The targets at this L for ``target_mode``, each with its value and verdict."""
    length = measured["length"]
    out = []
    for base, limit in TARGETS_LONG if length >= LONG_FROM else TARGETS_SHORT:
        value = measured["ratios"][target_mode][base]
        ok = value >= limit
        out.append({"length": length, "mode": target_mode, "baseline": base, "limit": limit, "value": value, "ok": ok,
                    "line": f"target L={length}: {target_mode} >= {limit:.2f}x {LABELS[base]} {base}: {value:.3f}x -> "
                            f"{'OK' if ok else 'MISS'}"})
    return out


def table_lines(measured: dict) -> list[str]:
    lines = [f"L={measured['length']}: {measured['admitted']} samples ({measured['dropped']} longer than L left out), "
             f"{measured['results'][0]['effective_tokens']} effective tokens; token budget {measured['rows']} x "
             f"{measured['length']} = {measured['budget']} per micro-batch",
             f"  {'mode':<32s} {'attention':<12s} {'call':<15s} {'steps':>5s} {'rows/step':>9s} {'padding':>8s} "
             f"{'seconds':>8s} {'tokens/s':>9s}"]
    for r in measured["results"]:
        lines.append(f"  {r['label'] + ' ' + r['mode']:<32s} {r['attention']:<12s} {r['call']:<15s} {r['steps']:5d} "
                     f"{r['rows_per_step']:9.1f} {r['padding_ratio']:8.1%} {r['seconds']:8.2f} "
                     f"{r['tokens_per_s']:9.1f}")
    lines.append(f"  {'ratio of tokens/s':<32s} " + " ".join(f"{LABELS[b] + ' ' + b:>24s}" for b in BASELINES))
    for mode, by_base in measured["ratios"].items():
        lines.append(f"  {mode:<32s} " + " ".join(f"{by_base[b]:>23.3f}x" for b in BASELINES))
    return lines


def summary_lines(per_length: list[dict]) -> list[str]:
    """Effective tokens/s of every mode at every L in one table (what the README shows)."""
    names = [r["mode"] for r in per_length[0]["results"]]
    lines = ["summary, effective tokens/s:", f"  {'L':>6s} " + " ".join(f"{n:>19s}" for n in names)]
    for measured in per_length:
        lines.append(f"  {measured['length']:>6d} " + " ".join(f"{r['tokens_per_s']:>19.1f}"
                                                              for r in measured["results"]))
    return lines


def report(args, per_length: list[dict], default_backend: str, seconds: float) -> dict:
    """Print the tables, the summary and the targets; return everything printed as a dict."""
    target_mode = f"{TARGET_STRATEGY}/{default_backend}"
    lines = [f"recipe {args.recipe}, {args.samples} demo samples, seed {args.seed}, torch threads "
             f"{torch.get_num_threads()}, best of {args.repeats} interleaved epochs per mode; (a)/(b) "
             f"{args.micro_batch} samples per micro-batch, (b) megabatches of {HF_MEGA_BATCH_MULT} x "
             f"{args.micro_batch}; timed: the trainer's step (prepare + forward + loss + backward + clip + AdamW) per "
             "micro-batch; "
             f"packed default backend {default_backend}"]
    for measured in per_length:
        lines += table_lines(measured)
    lines += summary_lines(per_length)
    found = [t for measured in per_length for t in targets(measured, target_mode)]
    lines += [t["line"] for t in found]
    lines.append(f"bench time {seconds:.1f} s")
    print("\n".join(lines))
    return {"args": vars(args), "lengths": per_length, "targets": found, "ok": all(t["ok"] for t in found),
            "target_mode": target_mode, "default_backend": default_backend, "seconds": seconds, "lines": lines}


# ---------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="qwen2_vl", help="recipes/<name>/train.py and conf/<name>.yaml")
    parser.add_argument("--samples", type=int, default=300, help="demo.num_samples: records of the demo mix")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="L values: data.max_seq_len and packing max_seq_len")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="samples per (a)/(b) micro-batch (default 16, LLaVA-1.5's per-device batch)")
    parser.add_argument("--packed-backends", nargs="+", default=[SDPA_VARLEN, "sdpa"],
                        help="attention backends of the packed modes (the default packed backend is always run)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; each mode keeps its fastest")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="demo data, batch orders, plans and initial weights")
    args = parser.parse_args(argv)
    for name in ("samples", "micro_batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.lengths) < 2 or args.threads < 0:
        parser.error("--lengths must be >= 2 and --threads >= 0")
    return args


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[dict], str]:
    recipe = load_recipe(args.recipe)
    cfg = run_config(args, workdir, max(args.lengths))
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    cfg_model = cfg.model
    processor = recipe.build_processor(cfg_model)
    default_backend = resolve_attention(AUTO_ATTENTION, recipe.attention_backends, packed=True)
    backends = list(dict.fromkeys([PADDED_ATTENTION, SDPA_VARLEN, *packed_backends(args, default_backend)]))
    harness = build_harness(recipe, specs, processor, cfg_model, backends)
    data = read_data(specs, recipe, processor)
    per_length = [measure_length(args, harness, workdir, length, data, default_backend)
                  for length in sorted(set(args.lengths))]
    return per_length, default_backend


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
            per_length, default_backend = run(args, Path(tmp))
        return report(args, per_length, default_backend, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process by the tests


if __name__ == "__main__":
    main()
