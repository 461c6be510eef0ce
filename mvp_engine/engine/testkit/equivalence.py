"""Packed equivalence: a packed forward/backward computes exactly what one-by-one forwards/backwards compute.

The case: real records (PIL images written to a temp dir: image samples, text-only samples, a multi-image
multi-turn sample, and a PyAV clip when the recipe's encoder takes video) encoded by the recipe's own encoder,
packed into two rows that both end in padding through the
DataKit's ``MLLMPack`` / ``MLLMCollator`` (the batches training sees). The reference: each sample alone, through
the recipe's ``prepare_padded`` on a one-row batch without padding (the model's own positions and causal mask),
computed once per case on sdpa in fp32 and shared by every backend compared on CPU (``one_by_one_reference``).
Compared, in fp32 on CPU for eager / sdpa / flex_attention (flash: CUDA and bf16 only):

- logits of every segment: max abs difference <= ``tol`` (1e-5);
- the token-mean loss of the packed batch (the engine's ``weighted_token_loss``) equals the token-weighted mean of
  the separate losses;
- every parameter gradient of that loss, relative difference <= ``tol`` (not on CPU for flex_attention: torch's
  FlexAttention has no CPU backward).

``check_withheld_linear_boundaries_are_caught`` is the negative check of a hybrid model (linear-attention layers,
Qwen3.5): with their boundaries withheld the report must fail by more than ``LEAK_FLOOR`` (1e-2).
``check_flash_kwargs_with_reference_attention`` covers the flash path on CPU: the kwargs ``prepare_packed`` builds
for flash go through the model into the sdpa_varlen backend (same kwargs) and must give one-by-one logits.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMPack, MLLMSample
from mvp_engine.packing import SDPA_VARLEN, has_linear_attention, is_flash, row_segments
from mvp_engine.packing.attention import FLEX
from mvp_engine.packing.linear_attention import BOUNDARIES

from ..config import ModelSpec
from ..lora import LoraSpec, add_adapters
from ..loss import weighted_token_loss
from ..quantize import quantize_base
from ..recipe import Recipe
from .records import demo_like_records, video_record
from .structure import backward_available, compose_config, load_recipe

TOL = 1e-5
LOW_PRECISION_TOL = 3e-2
LEAK_FLOOR = 1e-2  # what withheld boundaries must cost at least, so a leak can never pass as rounding noise


def collate_rows(rows: list[list[MLLMSample]], pad_token_id: int, extra_pad: int = 3) -> dict:
    """The DataKit's own pack + collate of ``rows``, padded to the longest row plus ``extra_pad`` tokens."""
    width = max(sum(s.length for s in row) for row in rows) + extra_pad
    collator = MLLMCollator(pad_token_id=pad_token_id, pad_to_multiple_of=width)
    return collator([MLLMPack(row).to_model_inputs() for row in rows])


@dataclass
class EquivalenceCase:
    """A recipe's tiny model config and processor, encoded demo-like samples and the packed batch of them."""

    recipe: Recipe
    model_cfg: Any
    processor: Any
    samples: list[MLLMSample]
    rows: list[list[MLLMSample]]
    batch: dict
    reference: OneByOne | None = field(default=None, repr=False)  # filled by ``one_by_one_reference``

    @property
    def pad_token_id(self) -> int:
        return self.recipe.pad_token_id(self.processor)

    def segments(self) -> list[tuple[int, int, int, MLLMSample]]:
        """``(row, start, end, sample)`` of every real segment of the packed batch."""
        flat = iter(s for row in self.rows for s in row)
        return [(row, start, end, next(flat))
                for row, runs in enumerate(row_segments(self.batch["pack_segment_ids"]))
                for seg, start, end in runs if seg >= 0]

    def alone(self, sample: MLLMSample) -> dict:
        """The one-row, unpadded batch of ``sample``: the one-by-one reference input."""
        return collate_rows([[sample]], self.pad_token_id, extra_pad=0)


def equivalence_case(name: str, workdir: Path) -> EquivalenceCase:
    """Rows ``[image, text-only, multi-image]`` and ``[text-only, image]`` (``[text-only, image, video]`` when the
    encoder takes video), both ending in padding."""
    recipe = load_recipe(name)
    model_cfg = compose_config(name).model
    processor = recipe.build_processor(model_cfg)
    encoder = recipe.build_encoder(processor)
    records = demo_like_records(Path(workdir))
    if getattr(encoder, "video_token", None):
        records.append(video_record(Path(workdir)))
    samples = [encoder.encode(record) for record in records]
    rows = [samples[:3], samples[3:]]
    batch = collate_rows(rows, recipe.pad_token_id(processor))
    assert (batch["pack_segment_ids"][:, -1] == -1).all(), "every row must end in padding"
    return EquivalenceCase(recipe, model_cfg, processor, samples, rows, batch)


@dataclass
class SegmentDiff:
    row: int
    start: int
    end: int
    sample_id: str
    max_abs: float


@dataclass
class EquivalenceReport:
    """What ``run_equivalence`` measured; ``failures()`` lists what is over ``tol``."""

    recipe: str
    backend: str
    dtype: str
    segments: list[SegmentDiff]
    packed_loss: float
    separate_loss: float
    grad_rel_diff: float | None
    tol: float
    notes: list[str] = field(default_factory=list)

    @property
    def max_logit_diff(self) -> float:
        return max(s.max_abs for s in self.segments)

    @property
    def loss_diff(self) -> float:
        return abs(self.packed_loss - self.separate_loss)

    def failures(self) -> list[str]:
        out = [f"segment {s.sample_id} (row {s.row}, tokens {s.start}:{s.end}): max logit diff {s.max_abs:.3e}"
               for s in self.segments if not s.max_abs <= self.tol]
        if not self.loss_diff <= self.tol:
            out.append(f"loss: packed {self.packed_loss:.8f} vs separate {self.separate_loss:.8f}")
        if self.grad_rel_diff is not None and not self.grad_rel_diff <= self.tol:
            out.append(f"gradients: max relative diff {self.grad_rel_diff:.3e}")
        return out + [note for note in self.notes if note.startswith("FAIL")]

    @property
    def ok(self) -> bool:
        return not self.failures()

    def lines(self) -> list[str]:
        head = f"{self.recipe} / {self.backend} ({self.dtype}, tolerance {self.tol:.0e})"
        rows = [f"  segment {s.sample_id:<8} row {s.row} tokens {s.start:>3}:{s.end:<3} "
                f"max |packed - one-by-one| logit diff {s.max_abs:.3e}" for s in self.segments]
        grads = ("not checked" if self.grad_rel_diff is None else f"{self.grad_rel_diff:.3e}")
        tail = [f"  max logit diff {self.max_logit_diff:.3e}",
                f"  loss packed {self.packed_loss:.8f} separate {self.separate_loss:.8f} diff {self.loss_diff:.3e}",
                f"  max relative grad diff {grads}", *(f"  {note}" for note in self.notes),
                "  OK" if self.ok else "  FAILED: " + "; ".join(self.failures())]
        return [head, *rows, *tail]

    def check(self) -> None:
        assert self.ok, "\n".join(self.lines())


def batch_to(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _relative_grad_diff(names: list[str], packed_grads, reference_grads) -> tuple[float, list[str]]:
    worst, problems = 0.0, []
    for name, g_packed, ref in zip(names, packed_grads, reference_grads):
        if ref.norm() > 1e-8:
            worst = max(worst, ((g_packed - ref).norm() / ref.norm()).item())
        elif g_packed.abs().max() > 1e-8:
            problems.append(f"FAIL: {name} has a packed gradient but no one-by-one gradient")
    return worst, problems


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for _, p in params]


@dataclass
class OneByOne:
    """Each sample of the case alone, through the recipe's ``prepare_padded`` on sdpa in fp32: the logits of every
    segment (``case.segments()`` order), the token-weighted mean of their losses, the supervised-token count and the
    gradient of that loss per parameter name."""

    logits: list[torch.Tensor]
    loss: float
    supervised: float
    grads: dict[str, torch.Tensor]
    model_cfg: Any  # what it was computed for: a case copied with another model config computes its own


def _one_by_one(case: EquivalenceCase, model, backend: str, device: str):
    """Logits per segment, the separate-loss tensor (not yet differentiated) and the supervised-token count."""
    logits, means, counts = [], [], []
    for *_, sample in case.segments():
        alone = batch_to(case.alone(sample), device)
        ref = model(**case.recipe.prepare_padded(alone, model, backend)).logits
        logits.append(ref[0].detach())
        part = weighted_token_loss(ref, alone["labels"], alone["pack_segment_ids"], "token")
        if part.weight_total > 0:
            means.append(part.weighted_sum / part.weight_total)
            counts.append(part.weight_total)
    return logits, sum(m * n for m, n in zip(means, counts)) / sum(counts), float(sum(counts))


def one_by_one_reference(case: EquivalenceCase) -> OneByOne:
    """The case's one-by-one reference, computed once and shared by every packed backend compared on CPU in fp32
    (and the flash kwargs check): one reference for all backends also catches a backend that is wrong packed and
    unpacked alike, which comparing each backend with itself cannot."""
    if case.reference is None or case.reference.model_cfg != case.model_cfg:
        model = case.recipe.build_model(case.model_cfg, "sdpa").eval()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        logits, loss, supervised = _one_by_one(case, model, "sdpa", "cpu")
        loss.backward()
        grads = dict(zip([n for n, _ in params], _grads(params)))
        case.reference = OneByOne(logits, loss.item(), supervised, grads, case.model_cfg)
    return case.reference


def with_random_adapters(model: torch.nn.Module, lora: LoraSpec, seed: int = 0) -> torch.nn.Module:
    """``model`` with ``lora``'s adapters, their B matrices drawn at random: peft starts them at zero, where the
    adapted model would compute the base model's logits and a packed leak through an adapter could not show."""
    model = add_adapters(model, lora, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def run_equivalence(case: EquivalenceCase, backend: str, *, prepare_packed: Callable | None = None,
                    device: str | None = None, dtype: torch.dtype | None = None,
                    tol: float | None = None, lora: LoraSpec | None = None,
                    quantization: str = "none") -> EquivalenceReport:
    """Packed vs one-by-one on ``backend`` (``prepare_packed`` overrides the recipe's, e.g. to prove a broken one
    is caught; ``lora``: on the model with those adapters, :func:`with_random_adapters`, whose gradients are the
    ones compared; ``quantization``: the layers they adapt quantized first, ``model.quantization``'s QLoRA). fp32
    on CPU by default; flash runs on CUDA in bf16 with a looser tolerance."""
    flash = is_flash(backend)
    device = device or ("cuda" if flash else "cpu")
    dtype = dtype or (torch.bfloat16 if flash else torch.float32)
    tol = tol if tol is not None else (TOL if dtype == torch.float32 else LOW_PRECISION_TOL)
    prepare = prepare_packed or case.recipe.prepare_packed
    if backend == FLEX and device == "cpu":
        # torch 2.13's inductor CPU flex template fails to compile (C++ error, 'cur_qSplitSize1' undeclared) when
        # dynamo recompiles flex with dynamic shapes after an earlier case's shapes (seen: llava's flex case, then
        # gemma4's in one process); every case compiles its own static kernels
        torch._dynamo.reset()
    model = case.recipe.build_model(case.model_cfg, backend)
    if quantization != "none":
        quantize_base(model, ModelSpec(quantization=quantization, lora=lora or LoraSpec()))
    if lora is not None:
        model = with_random_adapters(model, lora)
    model = model.to(device=device, dtype=dtype).eval()
    grads = backward_available(backend, device)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # as the run's collator hands it over: with the packed metadata computed on the CPU (Recipe.packed_metadata)
    batch = batch_to({**case.batch, **case.recipe.packed_metadata(model)(case.batch)}, device)
    notes = [] if grads else [f"gradients not checked: torch's FlexAttention has no backward on {device}"]

    shared = lora is None and device == "cpu" and dtype == torch.float32
    reference = one_by_one_reference(case) if shared else None
    with torch.set_grad_enabled(grads):
        logits = model(**prepare(batch, model, backend)).logits
        packed = weighted_token_loss(logits, batch["labels"], batch["pack_segment_ids"], "token")
        packed_loss = packed.weighted_sum / packed.weight_total
        packed_grads = []
        if grads:
            packed_loss.backward()
            packed_grads = _grads(params)
            model.zero_grad(set_to_none=True)
        if reference is not None:
            ref_logits, separate_loss, alone_total = reference.logits, reference.loss, reference.supervised
            ref_grads = [reference.grads[name] for name, _ in params]
            notes.append("one-by-one reference: sdpa, fp32, shared by every backend of the case")
        else:
            reference_backend = backend
            if backend == FLEX and device == "cpu":
                # transformers' own (unpacked) flex path on CPU gives NaN or run-to-run different logits for short
                # unpadded rows (measured: a 40-token LLaVA sample, 4 of 4 runs): the reference runs sdpa
                model.set_attn_implementation({"text_config": "sdpa"})
                reference_backend = "sdpa"
            ref_logits, loss, alone_total = _one_by_one(case, model, reference_backend, device)
            if grads:
                loss.backward()
                ref_grads = _grads(params)
            separate_loss = loss.detach().item()
        diffs = [SegmentDiff(row, start, end, sample.sample_id,
                             (logits[row, start:end].detach() - ref).abs().max().float().item())
                 for (row, start, end, sample), ref in zip(case.segments(), ref_logits)]
        if alone_total != float(packed.weight_total):
            notes.append(f"FAIL: {alone_total} supervised tokens one by one, {float(packed.weight_total)} packed")
        grad_diff = None
        if grads:
            grad_diff, problems = _relative_grad_diff([n for n, _ in params], packed_grads, ref_grads)
            notes += problems
    if lora is not None:
        backend = f"{backend} + LoRA r={lora.r} on {lora.target_modules}"
    return EquivalenceReport(case.recipe.name, backend, str(dtype).removeprefix("torch."), diffs,
                             packed_loss.detach().item(), separate_loss, grad_diff, tol, notes)


def without_linear_boundaries(prepare_packed: Callable) -> Callable:
    """``prepare_packed`` with the linear-attention boundaries withheld (the full-attention mask or varlen kwargs
    kept): the negative check of a hybrid model, whose report must show the leak (over ``LEAK_FLOOR``)."""

    def prepare(batch: dict, model, attn_implementation: str) -> dict:
        kwargs = prepare_packed(batch, model, attn_implementation)
        kwargs.pop(BOUNDARIES, None)
        return kwargs

    return prepare


def leak_not_seen(report: EquivalenceReport) -> list[str]:
    """Why a report run with the linear-attention boundaries withheld does not prove the check sees a leak: it must
    fail by more than ``LEAK_FLOOR``, every row's first sample staying exact (nothing before it to leak from)."""
    problems = [] if not report.ok and report.max_logit_diff > LEAK_FLOOR else [
        f"max logit diff {report.max_logit_diff:.1e} not over {LEAK_FLOOR:.0e}"]
    return problems + [f"segment {s.sample_id} (tokens {s.start}:{s.end}) max logit diff {s.max_abs:.1e}: "
                       + ("a row's first sample leaked" if s.start == 0 else "a later sample did not leak")
                       for s in report.segments if (s.max_abs <= report.tol) != (s.start == 0)]


def check_withheld_linear_boundaries_are_caught(case: EquivalenceCase,
                                                backend: str = "sdpa") -> EquivalenceReport | None:
    """A hybrid model (linear-attention layers): ``run_equivalence`` with the linear-attention boundaries withheld
    must show the leak (``leak_not_seen`` finds nothing), so the check provably sees a leak of the recurrent state
    or conv window. None for a model without them."""
    if not has_linear_attention(case.recipe.build_model(case.model_cfg, backend)):
        return None
    report = run_equivalence(case, backend, prepare_packed=without_linear_boundaries(case.recipe.prepare_packed))
    problems = leak_not_seen(report)
    assert not problems, "\n".join(problems + report.lines())
    return report


# --------------------------------------------------------------------------------------- flash kwargs, on CPU


@contextmanager
def language_model_reads(model, attn_implementation: str):
    """Make the model *say* its language model runs ``attn_implementation`` (what ``prepare_packed`` checks)."""
    config = getattr(model.config, "text_config", None) or model.config
    before = config._attn_implementation
    config._attn_implementation = attn_implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def check_flash_kwargs_with_reference_attention(case: EquivalenceCase, backend: str = "flash_attention_2",
                                                tol: float = TOL) -> float:
    """The flash path needs CUDA; on CPU its kwargs (varlen over the flattened batch, no attention_mask) go through
    the model, whose language model runs ``sdpa_varlen`` (the same varlen kwargs, computed by torch sdpa per span;
    the vision tower keeps sdpa), and must reproduce one-by-one logits. Returns the max logit difference."""

    model = case.recipe.build_model(case.model_cfg, "sdpa").eval()
    with language_model_reads(model, backend):
        kwargs = case.recipe.prepare_packed(case.batch, model, backend)
    assert "attention_mask" not in kwargs and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(kwargs["cu_seq_lens_q"], case.batch["cu_seqlens"].to(torch.int32))
    assert kwargs["max_length_q"] == case.batch["max_seqlen"]

    references = one_by_one_reference(case).logits
    with torch.no_grad():
        model.set_attn_implementation({"text_config": SDPA_VARLEN})
        logits = model(**kwargs).logits
    worst = max((logits[row, start:end] - ref).abs().max().item()
                for (row, start, end, _), ref in zip(case.segments(), references))
    assert worst <= tol, f"flash kwargs through the varlen reference: max logit diff {worst:.3e}"
    return worst
