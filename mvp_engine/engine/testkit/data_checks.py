"""Soft checks of the data path on a recipe's real run: packing knobs, a custom assembler, pack fields, padding,
accounting. Each takes the ``RecipeRun`` and returns ``(ok, evidence)``.

Why: a packing bug rarely crashes. A knob the spec never reads, a pack whose segment ids disagree with its plan,
padding that is attended or counted, or a step count that drifts from the run all train "fine" and silently change
what was learned; each check measures one link on the recipe's own encoder and demo data.
"""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import OmegaConf

from mvp_engine.kit.mllm.data import (
    IGNORE_INDEX,
    MLLMDataKit,
    MLLMPack,
    MLLMPackingAssembler,
    MLLMPackingSpec,
    TokenAccounting,
    optimizer_steps,
)
from mvp_engine.packing import segment_positions

from ..config import CONF_DIR
from ..plan_report import batch_accounting, micro_batches, rank_rows
from .evidence import eq, verdict
from .recipe_run import RecipeRun

ASSEMBLER_PATH = "mvp_engine.engine.testkit.data_checks.NextFitAssembler"
FIELD_PACKS = 3  # packs whose fields pack-fields inspects


class NextFitAssembler(MLLMPackingAssembler):
    """A custom algorithm for ``custom-assembler``: next-fit in stream order (one open pack, closed as soon as the
    next sample does not fit or a cap is reached). Counts its calls so the check can prove it was the planner."""

    calls = 0

    def group(self, order, lengths, media_counts, rng):
        type(self).calls += 1
        spec, packs, current, used, media = self.spec, [], [], 0, 0
        for i in order:
            full = used + lengths[i] > spec.max_seq_len
            if spec.max_media_per_pack is not None:
                full = full or media + media_counts[i] > spec.max_media_per_pack
            if spec.max_samples_per_pack is not None:
                full = full or len(current) >= spec.max_samples_per_pack
            if current and full:
                packs.append(current)
                current, used, media = [], 0, 0
            current.append(i)
            used += lengths[i]
            media += media_counts[i]
        return packs + ([current] if current else [])


def check_packing_knobs(run: RecipeRun) -> tuple[bool, str]:
    """A yaml key the spec lacks would be rejected or ignored, and a group file that does not extend
    ``packing_schema`` leaves the fields it does not write out of the composed config (unreachable without a ``+``):
    both make a knob mean something other than what the config says. The defaults themselves live in the dataclass;
    each file writes only what its group changes (``tests/test_config_defaults.py`` lists those)."""
    fields = [f.name for f in dataclasses.fields(MLLMPackingSpec)]
    problems, parts = [], []
    for path in sorted((CONF_DIR / "packing").glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path)) or {}
        keys = set(node) - {"defaults"}
        unknown, schema = sorted(keys - set(fields)), "packing_schema" in node.get("defaults", [])
        parts.append(f"{path.name} {'extends' if schema else 'does NOT extend'} packing_schema, sets {len(keys)}, "
                     f"{len(unknown)} unknown")
        if unknown or not schema:
            problems.append(f"{path.name}: unknown {unknown}" + ("" if schema else ", no packing_schema in defaults"))
    composed = OmegaConf.to_container(run.cfg.packing, resolve=True)
    same = [f for f in fields if composed.get(f) == getattr(run.packing, f)]
    if len(same) != len(fields):
        problems.append(f"composed packing -> spec differs on {sorted(set(fields) - set(same))}")
    evidence = (f"MLLMPackingSpec {len(fields)} fields; " + ", ".join(parts)
                + f"; composed packing -> spec {len(same)}/{len(fields)} values equal")
    return verdict(problems, evidence)


def next_fit_boundaries(packs: list[list[int]], lengths, media: list[int], spec: MLLMPackingSpec) -> int:
    """Pack boundaries a next-fit draws: the next pack's first sample did not fit (tokens or media) or the pack was
    at ``max_samples_per_pack``."""
    good = 0
    for pack, following in zip(packs, packs[1:]):
        first = following[0]
        tokens_over = sum(lengths[i] for i in pack) + lengths[first] > spec.max_seq_len
        media_over = (spec.max_media_per_pack is not None
                      and sum(media[i] for i in pack) + media[first] > spec.max_media_per_pack)
        capped = spec.max_samples_per_pack is not None and len(pack) >= spec.max_samples_per_pack
        good += tokens_over or media_over or capped
    return good


def check_custom_assembler(run: RecipeRun) -> tuple[bool, str]:
    """``assembler_cls`` is the only door for a new algorithm; prove it opens on real metadata, by dotted path."""
    data = dataclasses.replace(run.trainer.specs.data,
                               packing=dataclasses.replace(run.packing, assembler_cls=ASSEMBLER_PATH))
    dataset = MLLMDataKit.build_dataset(data, run.trainer.encoder, records=run.dataset.records)
    cls = type(dataset.assembler)
    before = NextFitAssembler.calls
    plan, builtin = dataset.plan(0), run.dataset.plan(0)
    calls = NextFitAssembler.calls - before
    placed = [i for pack in plan.packs for i in pack]
    admitted = set(range(len(dataset.records))) - set(plan.dropped)
    longest = max(sum(plan.lengths[i] for i in pack) for pack in plan.packs)
    media = [meta.num_media for meta in dataset.metas]
    boundaries = next_fit_boundaries(list(plan.packs), plan.lengths, media, data.packing)
    problems = []
    if cls is not NextFitAssembler or calls < 1:
        problems.append(f"planned by {cls.__name__} ({calls} NextFitAssembler.group calls)")
    if sorted(placed) != sorted(admitted):
        problems.append(f"{len(placed)} placements for {len(admitted)} admitted records")
    if longest > data.packing.max_seq_len:
        problems.append(f"a pack holds {longest} tokens > {data.packing.max_seq_len}")
    if boundaries != len(plan.packs) - 1:
        problems.append(f"{boundaries}/{len(plan.packs) - 1} boundaries are next-fit")
    if plan.drop_counts != builtin.drop_counts:
        problems.append(f"drops {dict(plan.drop_counts)} vs built-in {dict(builtin.drop_counts)}")
    served = dataset[0]["source_sample_num"]
    if served != len(plan.packs[0]):
        problems.append(f"dataset[0] serves {served} samples, the plan's first pack holds {len(plan.packs[0])}")
    evidence = (f"assembler_cls={ASSEMBLER_PATH!r} -> {cls.__name__} (group called {calls}x) planned "
                f"{len(dataset.records)} demo records into {len(plan.packs)} packs (built-in {run.packing.strategy}: "
                f"{len(builtin.packs)}) in {type(dataset).__name__}, dataset[0] serves "
                f"{eq(served, len(plan.packs[0]))} samples; {len(admitted)} admitted, each in exactly one pack; "
                f"longest pack {longest} <= {data.packing.max_seq_len}; next-fit boundaries "
                f"{boundaries}/{len(plan.packs) - 1}; drops {eq(dict(plan.drop_counts), dict(builtin.drop_counts))} "
                "(built-in's)")
    return verdict(problems, evidence)


def served_packs(run: RecipeRun, count: int) -> list[tuple[list[int], dict]]:
    """The first ``count`` packs of epoch 0 as the dataset serves them (``encode_pack``: what ``__getitem__`` and
    ``__iter__`` yield; iterating a streaming dataset partly would move its resume counter)."""
    packs = [p for p in run.dataset.rank_packs(0) if p][:count]
    return [(pack, run.dataset.encode_pack(pack, 0)) for pack in packs]


def pack_field_problems(pack: list[int], inputs: dict, lengths) -> list[str]:
    """What is wrong with one pack's ``to_model_inputs`` against its planned records."""
    planned = [lengths[i] for i in pack]
    starts = torch.tensor([0, *planned[:-1]]).cumsum(0)
    segments = inputs.get("pack_segment_ids")
    problems = [f"missing {key}" for key in ("pack_segment_ids", "source_sample_num") if key not in inputs]
    if problems:
        return problems
    expected = torch.repeat_interleave(torch.arange(len(pack)), torch.tensor(planned))
    if inputs["source_sample_num"] != len(pack):
        problems.append(f"source_sample_num {inputs['source_sample_num']} for {len(pack)} planned samples")
    if not torch.equal(segments, expected):
        problems.append("pack_segment_ids do not follow the planned lengths")
    elif not torch.equal(inputs["position_ids"], segment_positions(segments[None])[0]):
        problems.append("position_ids do not restart at every segment")
    if not bool((inputs["labels"][starts] == IGNORE_INDEX).all()):
        problems.append("a segment's first label is supervised")
    cu = inputs["cu_seqlens"]
    if cu.dtype != torch.int32 or cu.tolist() != [0, *torch.tensor(planned).cumsum(0).tolist()]:
        problems.append(f"cu_seqlens {cu.tolist()} ({cu.dtype}) for lengths {planned}")
    return problems


def check_pack_fields(run: RecipeRun) -> tuple[bool, str]:
    """Segment ids are the truth every mask and position derives from; a pack must carry them and its sample count
    exactly as planned."""
    lengths = run.dataset.plan(0).lengths
    packs = served_packs(run, FIELD_PACKS)
    per_pack = [pack_field_problems(pack, inputs, lengths) for pack, inputs in packs]
    problems = [f"pack {k}: {p}" for k, found in enumerate(per_pack) for p in found]
    counts = [inputs.get("source_sample_num") for _, inputs in packs]
    segments = [int(inputs["pack_segment_ids"].max()) + 1 for _, inputs in packs if "pack_segment_ids" in inputs]
    evidence = (f"{len(packs)} packs of {type(run.dataset).__name__} ({run.packing.strategy}): source_sample_num "
                f"{counts}, segments {segments}, planned samples {[len(p) for p, _ in packs]}, tokens "
                f"{[len(inputs['input_ids']) for _, inputs in packs]}; {sum(not found for found in per_pack)}/"
                f"{len(packs)} match plan lengths, restarting positions, -100 first labels, int32 cu_seqlens")
    return verdict(problems, evidence)


def padding_problems(batch: dict, lengths: list[int], pad_id: int) -> tuple[list[str], int]:
    """Inactive-value violations over every row's padding, and the number of padding tokens inspected."""
    width = batch["input_ids"].shape[1]
    pad = torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]
    checks = {"input_ids": pad_id, "labels": IGNORE_INDEX, "pack_segment_ids": -1}
    problems = [f"{key}: {int((batch[key][pad] != value).sum())}/{int(pad.sum())} padding tokens not {value}"
                for key, value in checks.items() if bool((batch[key][pad] != value).any())]
    cu = set(batch["cu_seqlens"].tolist())
    for row, n in enumerate(lengths):
        if n < width and not torch.equal(batch["position_ids"][row, n:], torch.arange(width - n)):
            problems.append(f"row {row}: padding positions are not one fresh run 0..{width - n - 1}")
        inside = {row * width + k for k in range(n + 1, width)}
        if n < width and ({row * width + n, (row + 1) * width} - cu or inside & cu):
            problems.append(f"row {row}: padding is not one cu_seqlens segment")
    return problems, int(pad.sum())


def check_collator_padding(run: RecipeRun) -> tuple[bool, str]:
    """Padding must be inert: attended by no real token, never supervised, and never counted as a sample."""
    rows = [inputs for _, inputs in served_packs(run, 2)] + [MLLMPack([]).to_model_inputs()]
    collator = run.trainer.collator
    batch = collator(rows)
    lengths = [len(row["input_ids"]) for row in rows]
    problems, n_pad = padding_problems(batch, lengths, run.pad_token_id)
    if collator.pad_token_id != run.pad_token_id:
        problems.append(f"collator pads with {collator.pad_token_id}, the recipe's pad id is {run.pad_token_id}")
    samples = batch["source_sample_num"].tolist()
    if samples != [row["source_sample_num"] for row in rows] or samples[-1] != 0:
        problems.append(f"source_sample_num {samples}")
    counted = TokenAccounting.from_batch(batch)
    if (counted.effective, counted.packs, counted.samples) != (sum(lengths), len(rows) - 1, sum(samples)):
        problems.append(f"accounting effective {counted.effective}, packs {counted.packs}, samples {counted.samples}")
    evidence = (f"{len(rows)} rows x width {batch['input_ids'].shape[1]} (2 real packs + 1 all-padding), "
                f"{n_pad} padding tokens: input_ids pad id {run.pad_token_id}, labels -100, pack_segment_ids -1, "
                f"positions a fresh run, one cu_seqlens segment per padding run; source_sample_num {samples}; "
                f"accounting effective {eq(counted.effective, sum(lengths))}, packs "
                f"{eq(counted.packs, len(rows) - 1)}")
    return verdict(problems, evidence)


def counted_pass(run: RecipeRun) -> tuple[TokenAccounting, list[int]]:
    """Every epoch through the run's own loader (the trainer's: same DataLoader, collator, workers), counted."""
    total, micro = TokenAccounting(), []
    for epoch in range(run.trainer.specs.train.epochs):
        batches = 0
        for batch in run.trainer._loader(epoch):
            total = total + TokenAccounting.from_batch(batch)
            batches += 1
        micro.append(batches)
    return total, micro


def planned_totals(run: RecipeRun) -> dict[str, int]:
    """What the plan says this rank trains over the same epochs: its packs cut into micro-batches as the loader cuts
    them (``train.drop_last`` leaves the short tail out), with slots and attention work by the engine's plan report
    (``batch_accounting``: the collated-width rule). ``plan_samples`` counts every planned sample, trained or not."""
    train, dataset = run.trainer.specs.train, run.dataset
    out = dict.fromkeys(("samples", "packs", "effective", "slots", "attention_work", "plan_samples"), 0)
    for epoch in range(train.epochs):
        plan = dataset.plan(epoch)
        groups = micro_batches(rank_rows(dataset, dataset.rank, epoch), train.micro_batch_size, train.drop_last)
        trained = [pack for group in groups for pack in group]
        predicted = batch_accounting(dataset, epoch, train)
        out["samples"] += sum(len(pack) for pack in trained)
        out["packs"] += sum(1 for pack in trained if pack)
        out["effective"] += sum(plan.lengths[i] for pack in trained for i in pack)
        out["slots"] += predicted["slots"]
        out["attention_work"] += predicted["attention_work"]
        out["plan_samples"] += sum(len(pack) for pack in plan.packs)
    return out


def check_accounting(run: RecipeRun) -> tuple[bool, str]:
    """Throughput, padding and the LR schedule are computed from these numbers; they must be what training sees."""
    train, trainer = run.trainer.specs.train, run.trainer
    counted, micro = counted_pass(run)
    planned = planned_totals(run)
    estimate = run.dataset.estimate_total_steps(train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    steps = sum(optimizer_steps(n, train.gradient_accumulation_steps) for n in micro)
    problems = [f"{key} counted {getattr(counted, key)} vs planned {value}" for key, value in planned.items()
                if key != "plan_samples" and getattr(counted, key) != value]
    if not steps == estimate == trainer.total_steps:
        problems.append(f"steps counted {steps}, dataset.estimate_total_steps {estimate}, "
                        f"Trainer.total_steps {trainer.total_steps}")
    drops = dict(run.dataset.plan(0).drop_counts)
    untrained = planned["plan_samples"] - planned["samples"]
    tail = f" (+{untrained} planned samples in the drop_last tail)" if untrained else ""
    evidence = (f"{train.epochs} epochs counted through the run's loader vs planned: samples "
                f"{eq(counted.samples, planned['samples'])}{tail}, packs {eq(counted.packs, planned['packs'])}, "
                f"effective tokens {eq(counted.effective, planned['effective'])}, total slots "
                f"{eq(counted.slots, planned['slots'])} "
                f"(padding {counted.padding_ratio:.1%}), attention work "
                f"{eq(counted.attention_work, planned['attention_work'])}, supervised {counted.supervised}; "
                f"micro-batches {micro} -> {steps} optimizer steps (accumulation {train.gradient_accumulation_steps}), "
                f"dataset.estimate_total_steps {estimate}, Trainer.total_steps {trainer.total_steps}; drops in "
                f"epoch 0 {drops}")
    return verdict(problems, evidence)
