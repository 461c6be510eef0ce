"""Validate a recipe's packed behaviour: one line per check, PASS or FAIL, with the numbers behind it.

Why: a packing bug rarely crashes. A mask that lets samples see each other, a knob the spec never reads or a step
count that drifts from the run all train "fine" and silently change what was learned. Each check here measures one
link of the data flow on the recipe's own encoder, tiny model and demo data, and prints the evidence, so a review
can quote numbers instead of adjectives.

    python tools/validate_recipe.py qwen2_vl
    python tools/validate_recipe.py llava +packing=bfd data.max_seq_len=512 demo.num_samples=40
    python tools/validate_recipe.py qwen2_vl --hard
    python tools/validate_recipe.py llava --recipe-module tests.fixtures.broken_recipe.train

``<recipe>`` names ``conf/<recipe>.yaml`` and ``recipes/<recipe>``; the ``Recipe`` validated is ``RECIPE`` of
``recipes.<recipe>.train``, or of ``--recipe-module`` (a test fixture, a recipe under development). Hydra overrides
after the name apply to the composed config, after this tool's small defaults (``DEFAULT_OVERRIDES``: a 32-record
demo set in a temp dir, ``data.max_seq_len=512``, micro-batches of 2, 2 epochs; ``+packing=greedy`` unless a
``+packing=...`` is given).

Soft checks (in process):

- ``packing-knobs``: every key of every ``conf/packing/*.yaml`` is a field of ``MLLMPackingSpec`` and every field is
  set in each yaml; the composed ``packing`` node reaches the spec value for value.
- ``custom-assembler``: ``MLLMPackingSpec(assembler_cls="tools.validate_recipe.NextFitAssembler")`` plans the
  recipe's real demo metadata with that class (next-fit boundaries verified, drops equal the built-in's).
- ``pack-fields``: the first packs the dataset serves carry ``pack_segment_ids`` and ``source_sample_num`` that
  match the plan (segment lengths, restarting positions, -100 first labels, ``cu_seqlens``).
- ``collator-padding``: the run's ``MLLMCollator`` pads real packs and an empty one with the inactive values.
- ``model-preparation``: the testkit's ``run_equivalence`` (the check ``tools/check_packed_equivalence.py`` runs)
  on two real packs of the demo plan, for every backend of the recipe this machine runs; flash kwargs through
  ``sdpa_varlen`` on CPU where flash cannot run. Packed logits, loss and gradients must equal one-by-one ones. A
  hybrid model (linear-attention layers, Qwen3.5) also runs with its linear-attention boundaries withheld, which
  must cost more than ``LEAK_FLOOR`` (1e-2): the check provably sees a state or conv-window leak.
- ``accounting``: a counted pass over every epoch through the run's own loader and collator
  (``TokenAccounting.from_batch``) against the plan, ``tools/pack_report.py``'s slot prediction and
  ``dataset.estimate_total_steps``.

``--hard`` adds the seed's hard checks as subprocesses: ``compileall`` of the DataKit and the recipe, then the
recipe's ``tests/test_structure.py`` and ``tests/test_smoke.py``.

Exit code: 0 when every check passes, 1 when any fails, 2 when validation cannot start (config error, no recipe).
``main(argv)`` returns that code; ``validate(...)`` returns the ``CheckResult`` list.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as ``python tools/validate_recipe.py``; also makes the dotted path import
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from mvp_engine.engine.config import CONF_DIR, ConfigError  # noqa: E402
from mvp_engine.engine.recipe import Recipe  # noqa: E402
from mvp_engine.engine.testing import (  # noqa: E402
    LEAK_FLOOR,
    TOL,
    EquivalenceCase,
    check_flash_kwargs_with_reference_attention,
    collate_rows,
    compose_config,
    run_equivalence,
    runnable_backends,
    without_linear_boundaries,
)
from mvp_engine.engine.trainer import Trainer  # noqa: E402
from mvp_engine.kit.mllm.data import (  # noqa: E402
    IGNORE_INDEX,
    MLLMDataKit,
    MLLMPack,
    MLLMPackingAssembler,
    MLLMPackingSpec,
    TokenAccounting,
    optimizer_steps,
)
from mvp_engine.packing import has_linear_attention, is_flash, segment_positions  # noqa: E402
from tools.pack_report import batch_accounting, micro_batches, rank_rows  # noqa: E402

DEFAULT_OVERRIDES = ("demo.num_samples=32", "data.max_seq_len=512", "train.micro_batch_size=2", "train.epochs=2")
DEFAULT_PACKING = "+packing=greedy"
ASSEMBLER_PATH = "tools.validate_recipe.NextFitAssembler"
FIELD_PACKS = 3  # packs whose fields pack-fields inspects
EQUIVALENCE_PACKS = 2  # real packs model-preparation runs packed vs one by one


# --- results -------------------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """One check's verdict and the evidence it rests on (numbers, so a review can quote them)."""

    name: str
    ok: bool
    evidence: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.evidence}"


def _verdict(problems: list[str], evidence: str) -> tuple[bool, str]:
    """Evidence always; the problems first when there are any, so a FAIL line says what broke."""
    return (not problems, evidence if not problems else "; ".join(problems) + " | " + evidence)


def _eq(counted, expected) -> str:
    """``a = b`` or ``a != b``: evidence that reads right whether the check passed or not."""
    return f"{counted} {'=' if counted == expected else '!='} {expected}"


def first_line(err: BaseException) -> str:
    """The error's first line; for a bare ``assert`` (no message) the failing source line, which says what broke."""
    lines = str(err).strip().splitlines()
    if lines:
        return lines[0]
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].line if frames and frames[-1].line else type(err).__name__


def run_check(name: str, check: Callable[[Context], tuple[bool, str]], ctx: Context) -> CheckResult:
    """A check that raises fails with the exception's first line: one broken link must not hide the others."""
    try:
        ok, evidence = check(ctx)
    except Exception as err:  # noqa: BLE001 - any error is this check's failure, reported on its line
        ok, evidence = False, f"{type(err).__name__}: {first_line(err)}"
    return CheckResult(name, ok, evidence)


# --- the run under validation --------------------------------------------------------------------------------


@dataclass
class Context:
    """The recipe and the run's own objects: ``Trainer`` builds the dataset, collator, encoder and step estimate
    exactly as a training run would, so the checks look at what training uses, not at a re-implementation."""

    name: str
    recipe: Recipe
    cfg: DictConfig
    trainer: Trainer

    @property
    def dataset(self):
        return self.trainer.dataset

    @property
    def packing(self) -> MLLMPackingSpec:
        return self.trainer.specs.data.packing

    @property
    def pad_token_id(self) -> int:
        return self.recipe.pad_token_id(self.trainer.processor)


def load_recipe_object(name: str, module: str | None = None) -> Recipe:
    """``RECIPE`` of ``module`` (default ``recipes.<name>.train``)."""
    module = module or f"recipes.{name}.train"
    recipe = getattr(importlib.import_module(module), "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"{module} has no RECIPE (a mvp_engine.engine.recipe.Recipe)")
    return recipe


def compose_overrides(user: Sequence[str], workdir: Path) -> list[str]:
    """The tool's defaults, then the user's overrides (last wins); greedy packing unless the user chose one."""
    chooses_packing = any(o.lstrip("+~").split("=")[0] == "packing" for o in user)
    return [*DEFAULT_OVERRIDES, f"demo.out_dir={workdir / 'demo'}", f"train.output_dir={workdir / 'run'}",
            *([] if chooses_packing else [DEFAULT_PACKING]), *user]


def build_context(name: str, module: str | None, overrides: Sequence[str], workdir: Path) -> Context:
    """Compose the config as ``python -m recipes.<name>.train <overrides>`` would and build its ``Trainer``; packing is
    required, since every soft check is about packs."""
    recipe = load_recipe_object(name, module)
    cfg = compose_config(name, compose_overrides(overrides, workdir))
    if cfg.get("packing") is None:
        raise ConfigError("packing: this tool validates packed behaviour; give +packing=greedy or +packing=bfd")
    return Context(name, recipe, cfg, Trainer(cfg, recipe))


# --- soft checks ---------------------------------------------------------------------------------------------


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


def check_packing_knobs(ctx: Context) -> tuple[bool, str]:
    """A yaml key the spec lacks would be rejected or ignored, a field no yaml sets falls back to a dataclass
    default nobody sees in the config: both make a knob mean something other than what the config says."""
    fields = [f.name for f in dataclasses.fields(MLLMPackingSpec)]
    problems, parts = [], []
    for path in sorted((CONF_DIR / "packing").glob("*.yaml")):
        keys = set(OmegaConf.to_container(OmegaConf.load(path)) or {}) - {"defaults"}
        unknown, unset = sorted(keys - set(fields)), sorted(set(fields) - keys)
        parts.append(f"{path.name} {len(fields) - len(unset)}/{len(fields)} set, {len(unknown)} unknown")
        if unknown or unset:
            problems.append(f"{path.name}: unknown {unknown}, unset {unset}")
    composed = OmegaConf.to_container(ctx.cfg.packing, resolve=True)
    same = [f for f in fields if composed.get(f) == getattr(ctx.packing, f)]
    if len(same) != len(fields):
        problems.append(f"composed packing -> spec differs on {sorted(set(fields) - set(same))}")
    evidence = (f"MLLMPackingSpec {len(fields)} fields; " + ", ".join(parts)
                + f"; composed packing -> spec {len(same)}/{len(fields)} values equal")
    return _verdict(problems, evidence)


def next_fit_boundaries(packs: list[list[int]], lengths, media: list[int],
                        spec: MLLMPackingSpec) -> int:
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


def check_custom_assembler(ctx: Context) -> tuple[bool, str]:
    """``assembler_cls`` is the only door for a new algorithm; prove it opens on real metadata, by dotted path."""
    data = dataclasses.replace(ctx.trainer.specs.data,
                               packing=dataclasses.replace(ctx.packing, assembler_cls=ASSEMBLER_PATH))
    dataset = MLLMDataKit.build_dataset(data, ctx.trainer.encoder, records=ctx.dataset.records)
    cls = type(dataset.assembler)
    before = getattr(cls, "calls", 0)  # the class the dotted path imported (a second copy when run as a script)
    plan, builtin = dataset.plan(0), ctx.dataset.plan(0)
    calls = getattr(cls, "calls", 0) - before
    placed = [i for pack in plan.packs for i in pack]
    admitted = set(range(len(dataset.records))) - set(plan.dropped)
    longest = max(sum(plan.lengths[i] for i in pack) for pack in plan.packs)
    media = [meta.num_media for meta in dataset.metas]
    boundaries = next_fit_boundaries(list(plan.packs), plan.lengths, media, data.packing)
    problems = []
    if cls.__name__ != "NextFitAssembler" or calls < 1:
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
                f"{len(dataset.records)} demo records into {len(plan.packs)} packs (built-in {ctx.packing.strategy}: "
                f"{len(builtin.packs)}) in {type(dataset).__name__}, dataset[0] serves "
                f"{_eq(served, len(plan.packs[0]))} samples; {len(admitted)} admitted, each in exactly one pack; "
                f"longest pack {longest} <= {data.packing.max_seq_len}; next-fit boundaries "
                f"{boundaries}/{len(plan.packs) - 1}; drops {_eq(dict(plan.drop_counts), dict(builtin.drop_counts))} "
                "(built-in's)")
    return _verdict(problems, evidence)


def served_packs(ctx: Context, count: int) -> list[tuple[list[int], dict]]:
    """The first ``count`` packs of epoch 0 as the dataset serves them (``encode_pack``: what ``__getitem__`` and
    ``__iter__`` yield; iterating a streaming dataset partly would move its resume counter)."""
    packs = [p for p in ctx.dataset.rank_packs(0) if p][:count]
    return [(pack, ctx.dataset.encode_pack(pack, 0)) for pack in packs]


def pack_field_problems(pack: list[int], inputs: dict, lengths: dict[int, int]) -> list[str]:
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


def check_pack_fields(ctx: Context) -> tuple[bool, str]:
    """Segment ids are the truth every mask and position derives from; a pack must carry them and its sample count
    exactly as planned."""
    lengths = ctx.dataset.plan(0).lengths
    packs = served_packs(ctx, FIELD_PACKS)
    per_pack = [pack_field_problems(pack, inputs, lengths) for pack, inputs in packs]
    problems = [f"pack {k}: {p}" for k, found in enumerate(per_pack) for p in found]
    counts = [inputs.get("source_sample_num") for _, inputs in packs]
    segments = [int(inputs["pack_segment_ids"].max()) + 1 for _, inputs in packs if "pack_segment_ids" in inputs]
    evidence = (f"{len(packs)} packs of {type(ctx.dataset).__name__} ({ctx.packing.strategy}): source_sample_num "
                f"{counts}, segments {segments}, planned samples {[len(p) for p, _ in packs]}, tokens "
                f"{[len(inputs['input_ids']) for _, inputs in packs]}; {sum(not found for found in per_pack)}/"
                f"{len(packs)} match plan lengths, restarting positions, -100 first labels, int32 cu_seqlens")
    return _verdict(problems, evidence)


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


def check_collator_padding(ctx: Context) -> tuple[bool, str]:
    """Padding must be inert: attended by no real token, never supervised, and never counted as a sample."""
    rows = [inputs for _, inputs in served_packs(ctx, 2)] + [MLLMPack([]).to_model_inputs()]
    collator = ctx.trainer.collator
    batch = collator(rows)
    lengths = [len(row["input_ids"]) for row in rows]
    problems, n_pad = padding_problems(batch, lengths, ctx.pad_token_id)
    if collator.pad_token_id != ctx.pad_token_id:
        problems.append(f"collator pads with {collator.pad_token_id}, the recipe's pad id is {ctx.pad_token_id}")
    samples = batch["source_sample_num"].tolist()
    if samples != [row["source_sample_num"] for row in rows] or samples[-1] != 0:
        problems.append(f"source_sample_num {samples}")
    counted = TokenAccounting.from_batch(batch)
    if (counted.effective, counted.packs, counted.samples) != (sum(lengths), len(rows) - 1, sum(samples)):
        problems.append(f"accounting effective {counted.effective}, packs {counted.packs}, samples {counted.samples}")
    evidence = (f"{len(rows)} rows x width {batch['input_ids'].shape[1]} (2 real packs + 1 all-padding), "
                f"{n_pad} padding tokens: input_ids pad id {ctx.pad_token_id}, labels -100, pack_segment_ids -1, "
                f"positions a fresh run, one cu_seqlens segment per padding run; source_sample_num {samples}; "
                f"accounting effective {_eq(counted.effective, sum(lengths))}, packs "
                f"{_eq(counted.packs, len(rows) - 1)}")
    return _verdict(problems, evidence)


def real_pack_case(ctx: Context) -> EquivalenceCase:
    """An ``EquivalenceCase`` over real packs of the demo plan (the first with several samples, images first), each
    row ending in padding, encoded by the recipe's encoder exactly as the dataset would (truncation included)."""
    plan, metas = ctx.dataset.plan(0), ctx.dataset.metas
    multi = [pack for pack in plan.packs if len(pack) > 1]
    multi.sort(key=lambda pack: not any(metas[i].num_media for i in pack[1:]))  # stable: media past segment 0 first
    rows = []
    for pack in multi[:EQUIVALENCE_PACKS]:
        samples = [ctx.trainer.encoder.encode(ctx.dataset.records[i]) for i in pack]
        rows.append([s.truncated(plan.lengths[i]) if plan.lengths[i] < s.length else s for i, s in zip(pack, samples)])
    if not rows:
        raise ValueError("no pack of the demo plan holds two samples: nothing to compare one by one")
    batch = collate_rows(rows, ctx.pad_token_id)
    return EquivalenceCase(ctx.recipe, ctx.cfg.model, ctx.trainer.processor, [s for r in rows for s in r], rows,
                           batch)


def describe_report(report) -> str:
    grads = "not checked (no backward here)" if report.grad_rel_diff is None else f"{report.grad_rel_diff:.1e}"
    over = sum(1 for s in report.segments if not s.max_abs <= report.tol)
    return (f"{report.backend} ({report.dtype}) max logit diff {report.max_logit_diff:.1e} "
            f"({over}/{len(report.segments)} segments over {report.tol:.0e}), loss diff {report.loss_diff:.1e}, "
            f"grad rel diff {grads}")


def over_tolerance(report) -> str:
    """What of a failed report is over its tolerance, counted."""
    parts = [f"{sum(1 for s in report.segments if not s.max_abs <= report.tol)}/{len(report.segments)} segments"]
    if not report.loss_diff <= report.tol:
        parts.append("loss")
    if report.grad_rel_diff is not None and not report.grad_rel_diff <= report.tol:
        parts.append("gradients")
    notes = [note for note in report.notes if note.startswith("FAIL")]
    return ", ".join(parts) + f" over {report.tol:.0e}" + "".join(f"; {note}" for note in notes)


def flash_reference(case: EquivalenceCase) -> tuple[bool, str]:
    """Flash cannot run here: its kwargs go through the model into ``sdpa_varlen`` (the testkit's check)."""
    try:
        worst = check_flash_kwargs_with_reference_attention(case)
    except AssertionError as err:
        return False, f"flash_attention_2 kwargs through sdpa_varlen on CPU: {first_line(err)}"
    except ValueError as err:  # a guard refusing the recipe's own flash kwargs
        return False, f"flash_attention_2 kwargs refused: {first_line(err)}"
    return True, f"flash_attention_2 kwargs through sdpa_varlen on CPU max logit diff {worst:.1e}"


def withheld_linear_boundaries(ctx: Context, case: EquivalenceCase, backends: list[str]) -> tuple[bool, str] | None:
    """A hybrid model: the same comparison with its linear-attention boundaries withheld must show the leak."""
    backend = next((b for b in ("sdpa", "eager") if b in backends), None)
    if backend is None or not has_linear_attention(ctx.trainer.model):
        return None
    report = run_equivalence(case, backend, prepare_packed=without_linear_boundaries(ctx.recipe.prepare_packed))
    caught = report.max_logit_diff > LEAK_FLOOR
    return caught, (f"{backend} with the linear-attention boundaries withheld max logit diff "
                    f"{report.max_logit_diff:.1e} ({'over' if caught else 'NOT over'} {LEAK_FLOOR:.0e})")


def check_model_preparation(ctx: Context) -> tuple[bool, str]:
    """Packed logits, loss and gradients equal one-by-one ones: no sample saw another and every sample kept its
    own (multimodal) positions. The comparison is the testkit's, on real packs instead of fixtures."""
    case = real_pack_case(ctx)
    backends = runnable_backends(ctx.recipe, training=False)
    parts, problems = [], []
    for backend in backends:
        report = run_equivalence(case, backend)
        parts.append(describe_report(report))
        if not report.ok:
            problems.append(f"{backend}: {over_tolerance(report)}")
    if "flash_attention_2" in ctx.recipe.attention_backends and not any(is_flash(b) for b in backends):
        ok, text = flash_reference(case)
        parts.append(text)
        if not ok:
            problems.append("flash_attention_2 kwargs differ")
    withheld = withheld_linear_boundaries(ctx, case, backends)
    if withheld is not None:
        parts.append(withheld[1])
        if not withheld[0]:
            problems.append("a linear-attention leak is not seen")
    images = sum(s.num_media for s in case.samples)
    head = (f"{len(case.rows)} real packs ({len(case.samples)} samples, {images} images, "
            f"{sum(s.length for s in case.samples)} tokens), tolerance {TOL:.0e}: ")
    skipped = [b for b in ctx.recipe.attention_backends if b not in backends]
    return _verdict(problems, head + "; ".join(parts) + (f"; not runnable here: {skipped}" if skipped else ""))


def counted_pass(ctx: Context) -> tuple[TokenAccounting, list[int]]:
    """Every epoch through the run's own loader (``Trainer._loader``: same DataLoader, collator, workers), counted."""
    total, micro = TokenAccounting(), []
    for epoch in range(ctx.trainer.specs.train.epochs):
        batches = 0
        for batch in ctx.trainer._loader(epoch):
            total = total + TokenAccounting.from_batch(batch)
            batches += 1
        micro.append(batches)
    return total, micro


def planned_totals(ctx: Context) -> dict[str, int]:
    """What the plan says this rank trains over the same epochs: its packs cut into micro-batches as the loader cuts
    them (``train.drop_last`` leaves the short tail out), with slots and attention work by ``tools/pack_report.py``'s
    collated-width rule. ``plan_samples`` counts every planned sample, trained or not."""
    train, dataset = ctx.trainer.specs.train, ctx.dataset
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


def check_accounting(ctx: Context) -> tuple[bool, str]:
    """Throughput, padding and the LR schedule are computed from these numbers; they must be what training sees."""
    train = ctx.trainer.specs.train
    counted, micro = counted_pass(ctx)
    planned = planned_totals(ctx)
    estimate = ctx.dataset.estimate_total_steps(train.epochs, train.micro_batch_size, train.gradient_accumulation_steps)
    steps = sum(optimizer_steps(n, train.gradient_accumulation_steps) for n in micro)
    problems = [f"{key} counted {getattr(counted, key)} vs planned {value}" for key, value in planned.items()
                if key != "plan_samples" and getattr(counted, key) != value]
    if not steps == estimate == ctx.trainer.total_steps:
        problems.append(f"steps counted {steps}, dataset.estimate_total_steps {estimate}, "
                        f"Trainer.total_steps {ctx.trainer.total_steps}")
    drops = dict(ctx.dataset.plan(0).drop_counts)
    untrained = planned["plan_samples"] - planned["samples"]
    tail = f" (+{untrained} planned samples in the drop_last tail)" if untrained else ""
    evidence = (f"{train.epochs} epochs counted through the run's loader vs planned: samples "
                f"{_eq(counted.samples, planned['samples'])}{tail}, packs {_eq(counted.packs, planned['packs'])}, "
                f"effective tokens {_eq(counted.effective, planned['effective'])}, total slots "
                f"{_eq(counted.slots, planned['slots'])} "
                f"(padding {counted.padding_ratio:.1%}), attention work "
                f"{_eq(counted.attention_work, planned['attention_work'])}, supervised {counted.supervised}; "
                f"micro-batches {micro} -> {steps} optimizer steps (accumulation {train.gradient_accumulation_steps}), "
                f"dataset.estimate_total_steps {estimate}, Trainer.total_steps {ctx.trainer.total_steps}; drops in "
                f"epoch 0 {drops}")
    return _verdict(problems, evidence)


SOFT_CHECKS: tuple[tuple[str, Callable[[Context], tuple[bool, str]]], ...] = (
    ("packing-knobs", check_packing_knobs),
    ("custom-assembler", check_custom_assembler),
    ("pack-fields", check_pack_fields),
    ("collator-padding", check_collator_padding),
    ("model-preparation", check_model_preparation),
    ("accounting", check_accounting),
)


# --- hard checks ---------------------------------------------------------------------------------------------


def hard_commands(name: str) -> list[tuple[str, list[str]]]:
    """The seed's hard checks for ``recipes/<name>``, as subprocess argument lists run from the repository root."""
    python = sys.executable
    return [
        ("compileall", [python, "-m", "compileall", "-q", "mvp_engine/kit/mllm/data", f"recipes/{name}"]),
        ("structure-tests", [python, "-m", "pytest", f"recipes/{name}/tests/test_structure.py", "-q"]),
        ("smoke-tests", [python, "-m", "pytest", f"recipes/{name}/tests/test_smoke.py", "-q"]),
    ]


def run_hard(name: str, command: list[str]) -> CheckResult:
    """A subprocess check: its exit code and last output line are the evidence."""
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no output"
    shown = " ".join(["python", *command[1:]])
    return CheckResult(name, result.returncode == 0, f"`{shown}` exit {result.returncode} in {seconds:.1f} s: {last}")


# --- entry point ---------------------------------------------------------------------------------------------


def validate(name: str, overrides: Sequence[str] = (), module: str | None = None, hard: bool = False,
             emit: Callable[[str], None] = print) -> list[CheckResult]:
    """Run every check, emitting each line as it completes; raises ``ConfigError`` when it cannot start."""
    results = []
    with tempfile.TemporaryDirectory(prefix="validate_recipe_") as workdir:
        ctx = build_context(name, module, overrides, Path(workdir))
        emit(f"validate_recipe: {ctx.recipe.name} (conf/{name}.yaml, {module or f'recipes.{name}.train'}), packing "
             f"{ctx.packing.strategy}, max_seq_len {ctx.packing.max_seq_len}, {len(ctx.dataset.records)} demo records")
        for check_name, check in SOFT_CHECKS:
            results.append(run_check(check_name, check, ctx))
            emit(results[-1].line())
    for check_name, command in hard_commands(name) if hard else []:
        results.append(run_hard(check_name, command))
        emit(results[-1].line())
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="conf/<recipe>.yaml and recipes/<recipe>")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +packing=bfd data.max_seq_len=512")
    parser.add_argument("--hard", action="store_true", help="also run compileall and the structure and smoke tests")
    parser.add_argument("--recipe-module", default=None,
                        help="module whose RECIPE is validated (default recipes.<recipe>.train)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine two OpenMP threads made "
                             "the tiny model's forwards 10-100x slower at random)")
    return parser.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = validate(args.recipe, args.overrides, args.recipe_module, args.hard,
                           emit=lambda line: print(line, flush=True))
    except (ConfigError, HydraException, ModuleNotFoundError) as err:
        print(f"cannot validate: {first_line(err)}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # called in process (tests), leave the caller's setting as it was
    failed = [r.name for r in results if not r.ok]
    print(f"result: {len(results) - len(failed)}/{len(results)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
