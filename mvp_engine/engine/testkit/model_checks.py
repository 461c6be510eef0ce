"""The ``model-preparation`` soft check: the testkit's packed == one-by-one comparison on real packs of a recipe's
demo plan, for every backend this machine runs.

Why real packs: the equivalence suites use fixture records; a plan of the recipe's own demo data puts samples next
to each other the way training does (media past the first segment, truncated tails), which is where a mask or a
position that leaks across samples shows.
"""

from __future__ import annotations

from mvp_engine.packing import is_flash

from .equivalence import (
    LEAK_FLOOR,
    TOL,
    EquivalenceCase,
    EquivalenceReport,
    check_flash_kwargs_with_reference_attention,
    check_withheld_linear_boundaries_are_caught,
    collate_rows,
    run_equivalence,
)
from .evidence import first_line, verdict
from .recipe_run import RecipeRun
from .structure import runnable_backends

EQUIVALENCE_PACKS = 2  # real packs compared packed vs one by one


def real_pack_case(run: RecipeRun) -> EquivalenceCase:
    """An ``EquivalenceCase`` over real packs of the demo plan (the first with several samples, images first), each
    row ending in padding, encoded by the recipe's encoder exactly as the dataset would (truncation included)."""
    plan, metas = run.dataset.plan(0), run.dataset.metas
    multi = [pack for pack in plan.packs if len(pack) > 1]
    multi.sort(key=lambda pack: not any(metas[i].num_media for i in pack[1:]))  # stable: media past segment 0 first
    rows = []
    for pack in multi[:EQUIVALENCE_PACKS]:
        samples = [run.trainer.encoder.encode(run.dataset.records[i]) for i in pack]
        rows.append([s.truncated(plan.lengths[i]) if plan.lengths[i] < s.length else s for i, s in zip(pack, samples)])
    if not rows:
        raise ValueError("no pack of the demo plan holds two samples: nothing to compare one by one")
    batch = collate_rows(rows, run.pad_token_id)
    return EquivalenceCase(run.recipe, run.cfg.model, run.trainer.processor, [s for r in rows for s in r], rows,
                           batch)


def segments_over(report: EquivalenceReport) -> int:
    return sum(1 for s in report.segments if not s.max_abs <= report.tol)


def describe_report(report: EquivalenceReport) -> str:
    grads = "not checked (no backward here)" if report.grad_rel_diff is None else f"{report.grad_rel_diff:.1e}"
    return (f"{report.backend} ({report.dtype}) max logit diff {report.max_logit_diff:.1e} "
            f"({segments_over(report)}/{len(report.segments)} segments over {report.tol:.0e}), loss diff "
            f"{report.loss_diff:.1e}, grad rel diff {grads}")


def over_tolerance(report: EquivalenceReport) -> str:
    """What of a failed report is over its tolerance, counted."""
    parts = [f"{segments_over(report)}/{len(report.segments)} segments"]
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


def withheld_linear_boundaries(case: EquivalenceCase, backends: list[str]) -> tuple[bool, str] | None:
    """A hybrid model: the testkit's check that withholding its linear-attention boundaries shows the leak."""
    backend = next((b for b in ("sdpa", "eager") if b in backends), None)
    if backend is None:
        return None
    try:
        report = check_withheld_linear_boundaries_are_caught(case, backend)
    except AssertionError as err:
        return False, f"{backend} with the linear-attention boundaries withheld: {first_line(err)}"
    if report is None:
        return None
    return True, (f"{backend} with the linear-attention boundaries withheld max logit diff "
                  f"{report.max_logit_diff:.1e} (over {LEAK_FLOOR:.0e})")


def check_model_preparation(run: RecipeRun) -> tuple[bool, str]:
    """Packed logits, loss and gradients equal one-by-one ones: no sample saw another and every sample kept its
    own (multimodal) positions."""
    case = real_pack_case(run)
    backends = runnable_backends(run.recipe, training=False)
    parts, problems = [], []
    for backend in backends:
        report = run_equivalence(case, backend)
        parts.append(describe_report(report))
        if not report.ok:
            problems.append(f"{backend}: {over_tolerance(report)}")
    if "flash_attention_2" in run.recipe.attention_backends and not any(is_flash(b) for b in backends):
        ok, text = flash_reference(case)
        parts.append(text)
        if not ok:
            problems.append("flash_attention_2 kwargs differ")
    withheld = withheld_linear_boundaries(case, backends)
    if withheld is not None:
        parts.append(withheld[1])
        if not withheld[0]:
            problems.append("a linear-attention leak is not seen")
    images = sum(s.num_media for s in case.samples)
    head = (f"{len(case.rows)} real packs ({len(case.samples)} samples, {images} images, "
            f"{sum(s.length for s in case.samples)} tokens), tolerance {TOL:.0e}: ")
    skipped = [b for b in run.recipe.attention_backends if b not in backends]
    return verdict(problems, head + "; ".join(parts) + (f"; not runnable here: {skipped}" if skipped else ""))
