"""Context parallelism's exactness checks: a whole packed row split over 2 gloo ranks computes what it computes
unsplit (logits of every position, the loss, every parameter's gradient summed over the CP ranks), per backend.

The rows are the equivalence case's (several samples with images, a text-only sample, the recipe's clip when it
takes video) padded so that the cut between the two ranks falls inside an image's placeholder run: its features
are cut by the exchange, never its pixels. The CP side runs on the session's two pooled ranks (``runs.run_on_ranks``,
a gloo group over a file store) on one saved batch, each with the engine's own ``sequence_parallel_forward``; the
unsplit reference runs in the first of them, so both sides see the same inputs and process state. The split side
runs under the collective-device check (``collectives.py``): a tensor made for a collective without its group's
device would reach NCCL as a CPU tensor on a GPU machine.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mvp_engine.packing import SequenceShard, enable_ulysses

from ..context_parallel import sequence_parallel_forward
from ..loss import weighted_token_loss
from ..participation import dummy_passes, media_kinds
from ..recipe import Recipe
from .collectives import collectives_on_their_groups_device
from .equivalence import EquivalenceCase, collate_rows
from .launch import final_weights, max_weight_difference, read_metrics, read_summary
from .runs import cached_run, run_on_ranks, shared_mixed_jsonl, train
from .structure import backward_available, compose_config, load_recipe

CP_SIZE = 2


def split_inside_media(case: EquivalenceCase, size: int = CP_SIZE) -> dict:
    """The case's rows padded to a width whose cut between CP ranks falls inside an image placeholder run of some
    row (searched over the padding; the padding is each row's own inactive segment)."""
    model = case.recipe.build_model(case.model_cfg, "sdpa")
    config = model.config
    image_token = getattr(config, "image_token_id", None) or config.image_token_index
    longest = max(sum(s.length for s in row) for row in case.rows)
    for extra in range(1, longest):
        batch = collate_rows(case.rows, case.pad_token_id, extra_pad=extra)
        width = batch["input_ids"].shape[1]
        if width % size:
            continue
        cut = width // size
        ids = batch["input_ids"]
        if bool(((ids[:, cut - 1] == image_token) & (ids[:, cut] == image_token)).any()):
            return batch
    raise AssertionError(f"{case.recipe.name}: no padding puts the CP cut inside an image's placeholder run")


@dataclass
class SplitReport:
    """CP = 2 vs unsplit on one backend."""

    backend: str
    max_logit_diff: float
    loss_diff: float
    grad_rel_diff: float | None  # None: backward not available on this machine (flex on CPU)

    def line(self) -> str:
        grads = "not checked (no CPU backward)" if self.grad_rel_diff is None else f"{self.grad_rel_diff:.2e}"
        return (f"{self.backend}: max logit diff {self.max_logit_diff:.2e}, loss diff {self.loss_diff:.2e}, "
                f"max relative grad diff {grads}")


def _forward_and_grads(recipe: Recipe, model_cfg, encoder, batch: dict, backend: str, shard: SequenceShard | None):
    """Logits (this rank's chunk under CP), this rank's part of the token-mean loss over the whole rows, and the
    parameter gradients (None where backward is not available)."""
    model = recipe.build_model(model_cfg, backend).eval()
    # the kinds the recipe's encoder feeds, with their own per-item fields, as training hands them to the vision
    # tower's share
    dummy, kinds = recipe.dummy_media(model), media_kinds(model, encoder)
    grads = backward_available(backend, "cpu")  # the CP ranks are gloo ranks: their models sit on the CPU
    with torch.set_grad_enabled(grads):
        kwargs = recipe.prepare_packed(batch, model, backend)
        if shard is None:
            outputs, zero, span = model(**kwargs), None, None
        else:
            enable_ulysses(model, shard)
            outputs, zero = sequence_parallel_forward(model, kwargs, shard, kinds, dummy, dummy_passes(batch, kinds))
            span = shard.span(batch["input_ids"].shape[-1])
        part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token", span)
        loss = part.weighted_sum / float((batch["labels"][:, 1:] != -100).sum())
        loss = loss if zero is None else loss + zero
        gradients = None
        if grads:
            loss.backward()
            gradients = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    return outputs.logits.detach(), loss.detach(), gradients


def _relative(gradients: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    worst = 0.0
    for g, ref in zip(gradients, reference):
        scale = float(ref.norm())
        worst = max(worst, float((g - ref).norm()) / scale if scale > 1e-8 else float(g.abs().max()))
    return worst


def _split_worker(rank: int, recipe_name: str, workdir: str, backends: list[str]) -> list[SplitReport] | None:
    """One CP rank, on the batch the caller saved (every process the same inputs, nothing encoded twice): per
    backend, rank 0 first runs the unsplit reference, then both ranks the split forward and backward; rank 0
    returns each backend's report."""
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=CP_SIZE)
    try:
        recipe, model_cfg = load_recipe(recipe_name), compose_config(recipe_name).model
        encoder = recipe.build_encoder(recipe.build_processor(model_cfg))
        batch = torch.load(Path(workdir) / "batch.pt")
        shard = SequenceShard(dist.group.WORLD, rank, CP_SIZE)
        reports = []
        for backend in backends:
            # flex without a CPU backward compares its forward with the unsplit row on sdpa: the same masked
            # attention (the equivalence suite holds flex == sdpa), without compiling flex a second time for the
            # whole row's shapes (5-10 s a recipe on a cold compile cache)
            unsplit = "sdpa" if not backward_available(backend, "cpu") else backend
            reference = _forward_and_grads(recipe, model_cfg, encoder, batch, unsplit, None) if rank == 0 else None
            with collectives_on_their_groups_device() as calls:  # each on its group's device, placed there
                logits, loss, gradients = _forward_and_grads(recipe, model_cfg, encoder, batch, backend, shard)
            assert "all_gather" in calls and "all_to_all_single_autograd" in calls, calls  # media counts, Ulysses
            pieces = [torch.empty_like(logits) for _ in range(CP_SIZE)]
            dist.all_gather(pieces, logits.contiguous())
            dist.all_reduce(loss)
            for g in gradients or ():
                dist.all_reduce(g)
            if rank == 0:
                ref_logits, ref_loss, ref_gradients = reference
                reports.append(SplitReport(backend, float((torch.cat(pieces, dim=1) - ref_logits).abs().max()),
                                           abs(float(loss) - float(ref_loss)),
                                           None if gradients is None else _relative(gradients, ref_gradients)))
        return reports if rank == 0 else None
    finally:
        dist.destroy_process_group()


def check_split_row_equivalence(case: EquivalenceCase, backends: list[str], workdir: Path) -> list[SplitReport]:
    """CP = 2 (two pooled gloo ranks) vs unsplit on each of ``backends``, on the case's rows cut inside an image
    (:func:`split_inside_media`): the whole rows' logits, the loss and every parameter gradient (summed over the CP
    ranks) agree; returns one report per backend."""
    workdir = Path(tempfile.mkdtemp(dir=workdir))
    torch.save(split_inside_media(case), workdir / "batch.pt")
    return run_on_ranks(CP_SIZE, _split_worker, case.recipe.name, str(workdir), list(backends))[0]


def check_split_training(recipe: str, run_dir: Path, split: tuple[int, int], reference: tuple[int, int],
                         epochs: int = 1, split_overrides: tuple[str, ...] = (), tol: float = 1e-5,
                         overrides: tuple[str, ...] = ()) -> str:
    """Real runs of ``recipe`` on mixed image / text-only data, (processes, CP size) ``split`` against
    ``reference``: the same steps and per-step counts (each row counted once), losses and final weights within
    ``tol``, estimated == actual steps (``split_overrides``: more keys of the split run, e.g. FSDP2; ``overrides``:
    of both runs; a MoE model's ``aux_loss`` and ``expert_load`` compared too). Returns the
    line with the measured differences. The reference is the session's (``cached_run``): checks of one recipe
    against the same reference share one run."""
    common = ["+packing=greedy", f"data.sources=[{shared_mixed_jsonl()}]", "data.shuffle=false",
              "data.max_seq_len=320", f"train.epochs={epochs}", "train.micro_batch_size=1", "train.learning_rate=5e-3",
              *overrides]
    train(recipe, run_dir / "split", [*common, f"train.context_parallel_size={split[1]}", *split_overrides],
          nproc=split[0])
    reference_dir = cached_run(recipe, [*common, f"train.context_parallel_size={reference[1]}"], nproc=reference[0])
    split_metrics, reference_metrics = read_metrics(run_dir / "split"), read_metrics(reference_dir)
    assert len(split_metrics) == len(reference_metrics) >= 2
    for key in ("samples", "effective_tokens", "supervised_tokens", "lr"):
        assert [m[key] for m in split_metrics] == [m[key] for m in reference_metrics], key
    loss = max(abs(a[key] - b[key]) for a, b in zip(split_metrics, reference_metrics)
               for key in ("loss", "aux_loss") if key in b)
    assert [m.get("expert_load") for m in split_metrics] == [m.get("expert_load") for m in reference_metrics]
    weights = max_weight_difference(final_weights(run_dir / "split"), final_weights(reference_dir))
    summary = read_summary(run_dir / "split")
    assert summary["estimated_steps"] == summary["actual_steps"] == len(split_metrics)
    assert summary["context_parallel_size"] == split[1]
    line = (f"{recipe} {split[0]} processes x CP {split[1]} {' '.join(split_overrides)} vs {reference[0]} x CP "
            f"{reference[1]}: "
            f"{len(split_metrics)} steps, max loss diff {loss:.2e}, max weight diff {weights:.2e}")
    assert loss <= tol and weights <= tol, line
    return line
