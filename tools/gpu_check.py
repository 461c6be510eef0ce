"""One prepared check of the project's GPU paths on one CUDA GPU (an H200 in mind), in under 8 minutes.

Prints one line per probe, ``OK`` / ``MISS`` / ``SKIP``, its name and what it measured or the one-line reason; a
probe that fails prints MISS and the others still run. Exit status 1 when a probe missed, else 0. Without CUDA it
prints that there is no GPU and exits 0 (nothing can be checked).

    python tools/gpu_check.py                      # every probe (--budget-s: later probes SKIP past it)
    python tools/gpu_check.py --list               # the probe names
    python tools/gpu_check.py --only packed:gemma3 --only memory-16k

Probes, each on the recipes' tiny models:

- ``packed:<family>:<backend>``: packed == one-by-one (``testkit.run_equivalence``, the check of
  ``tools/check_packed_equivalence.py``: logits of every segment, the loss, every gradient) in bf16 on CUDA within
  2e-2, on flash_attention_2, sdpa_varlen and flex_attention where the family offers them; ``packed-fp32:...`` on
  sdpa and sdpa_varlen in fp32 (TF32 off) within 1e-5. Every family in ``FAMILIES``.
- ``cp2`` / ``fsdp2-2ranks``: a short packed training on 2 ranks (torchrun, NCCL) with context parallelism 2 / FSDP2;
  SKIP with fewer than 2 GPUs.
- ``flex-recompiles``: torch.compile graphs of flex_attention over packed rows of several lengths (dynamo's
  counters); MISS when every length compiles its own.
- ``memory-16k``: ``torch.cuda.max_memory_allocated`` of one packed 16 k-token row's forward + loss + backward.
- ``host-syncs``: synchronising CUDA calls during one packed step (``torch.cuda.set_sync_debug_mode``), the batch
  with the collator's packed metadata as a run has it, and the test kit's count of them by caller
  (``testkit.host_syncs``); MISS over 30, or over 4 from the project's code, issue 28's targets per micro-batch.
- ``linear-attention-fla``: fla's varlen gated delta rule (packed Qwen3.5 linear attention on CUDA where
  flash-linear-attention is installed) against the exact torch reference per sample; SKIP without fla.
- ``nccl-group-timeout``: a one-rank NCCL group made with ``parallel.group_timeout_options`` waits the run's
  ``train.dist_timeout_s``.
- ``fused-losses``: ``train.loss_impl=liger`` / ``cce`` (where installed) against ``chunked``: loss and
  gradients with per-sample weights, fp32, within 1e-4; SKIP when neither package is installed.
- ``train``: a short packed bf16 training (a fresh process): tokens/s and MFU from its ``summary.json``. On a tiny
  model the MFU says more about the step's overhead than about the GPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch

# every recipe family; the first three are checked first (the budget may end before the rest)
FAMILIES = ("llava", "qwen2_vl", "gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "gemma4", "glm4v",
            "qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe")
BF16_BACKENDS = ("flash_attention_2", "sdpa_varlen", "flex_attention")
FP32_BACKENDS = ("sdpa", "sdpa_varlen")
BF16_TOL, FP32_TOL = 2e-2, 1e-5
LONG_ROW = 16384
RECOMPILE_PADS = (3, 21, 50, 90)  # extra padding of the packed rows: four pack lengths
SYNC_TARGET = 30
BUDGET_S = 450.0
NO_GPU = "no CUDA GPU here: tools/gpu_check.py checks the GPU paths and needs one; nothing checked"


class Skipped(Exception):
    """A probe that cannot run on this machine (a backend the family does not offer, one GPU for a 2-rank run)."""


class Probe(NamedTuple):
    name: str
    run: Callable[[Context], str]  # returns what it measured; raises Skipped, or anything else for MISS


class Context:
    """What probes share: one temporary folder and each family's packed case, built once."""

    def __init__(self, workdir: Path):
        self.workdir, self.cases = workdir, {}

    def case(self, family: str):
        from mvp_engine.engine.testing import equivalence_case

        if family not in self.cases:
            self.cases[family] = equivalence_case(family, self.workdir / family)
        return self.cases[family]


# ------------------------------------------------------------------------------------------------------ helpers


def offered(case, backend: str) -> None:
    """Skip unless the family offers ``backend`` and its package imports."""
    from mvp_engine.packing import BACKENDS

    if backend not in case.recipe.attention_backends:
        raise Skipped(f"{case.recipe.name} does not offer {backend}")
    package = BACKENDS[backend].package
    if package is not None and importlib.util.find_spec(package) is None:
        raise Skipped(f"the {package} package is not installed")


def fastest_packed_backend(case) -> str:
    """flash_attention_2 where offered and installed, else sdpa_varlen (what ``attention=auto`` prefers)."""
    try:
        offered(case, "flash_attention_2")
        return "flash_attention_2"
    except Skipped:
        return "sdpa_varlen"


@contextmanager
def exact_fp32():
    """fp32 without TF32 (cuDNN convolutions use it by default): packed == one-by-one within 1e-5 needs fp32 math."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def cuda_model(case, backend: str):
    return case.recipe.build_model(case.model_cfg, backend).to(device="cuda", dtype=torch.bfloat16).train()


def on_cuda(batch: dict) -> dict:
    from mvp_engine.engine.testkit.equivalence import batch_to

    return batch_to(batch, "cuda")


def with_metadata(case, model, batch: dict) -> dict:
    """``batch`` as the run's collator hands it over: with the packed metadata computed on the CPU
    (``Recipe.packed_metadata``), then on the GPU."""
    return on_cuda({**batch, **case.recipe.packed_metadata(model)(batch)})


def packed_step(case, model, batch: dict, backend: str) -> None:
    """prepare_packed + forward + token-mean loss + backward, as a training micro-batch runs."""
    from mvp_engine.engine.loss import weighted_token_loss

    logits = model(**case.recipe.prepare_packed(batch, model, backend)).logits
    part = weighted_token_loss(logits, batch["labels"], batch["pack_segment_ids"], "token")
    (part.weighted_sum / part.weight_total).backward()


def long_row(case, length: int = LONG_ROW) -> dict:
    """One packed row of ``length`` tokens: copies of a long text-only sample encoded by the family's encoder,
    the rest padding."""
    from mvp_engine.engine.testing import assistant, collate_rows, text, user
    from mvp_engine.kit.mllm.data import MLLMRecord

    words = " ".join(f"word{i % 97}" for i in range(700))
    encoder = case.recipe.build_encoder(case.processor)
    sample = encoder.encode(MLLMRecord("long", "gpu_check:1", [user(text(words)), assistant(words)]))
    count = length // sample.length
    return collate_rows([[sample] * count], case.pad_token_id, extra_pad=length - count * sample.length)


def launch_env() -> dict:
    """The environment of a probe's training: this machine's GPUs (the test suite's ``VLM_PACKING_DEVICE=cpu``
    dropped)."""
    from mvp_engine.engine.device import DEVICE_ENV

    return {key: value for key, value in os.environ.items() if key != DEVICE_ENV} | {"PYTHONUNBUFFERED": "1"}


def train_run(ctx: Context, recipe: str, name: str, nproc: int, overrides: list[str], timeout: float) -> dict:
    """A short packed bf16 training of ``recipe`` on ``nproc`` processes; its ``summary.json``."""
    from mvp_engine.engine.testing import read_summary
    from mvp_engine.engine.testkit.launch import REPO_ROOT, run_overrides, train_command

    run_dir = ctx.workdir / name
    common = ["+packing=greedy", "demo.num_samples=320", "train.epochs=1", "train.mixed_precision=bf16",
              f"demo.out_dir={ctx.workdir / 'demo'}"]
    result = subprocess.run(train_command(recipe, nproc) + run_overrides(run_dir, [*common, *overrides]),
                            capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=launch_env())
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"exit {result.returncode}: {last}")
    return read_summary(run_dir)


# ------------------------------------------------------------------------------------------------------- probes


def packed_probe(family: str, backend: str, dtype: torch.dtype) -> Probe:
    fp32 = dtype == torch.float32
    tol = FP32_TOL if fp32 else BF16_TOL

    def run(ctx: Context) -> str:
        from mvp_engine.engine.testing import run_equivalence

        case = ctx.case(family)
        offered(case, backend)
        with exact_fp32() if fp32 else nullcontext():
            report = run_equivalence(case, backend, device="cuda", dtype=dtype, tol=tol)
        grads = "not checked" if report.grad_rel_diff is None else f"{report.grad_rel_diff:.2e}"
        measured = (f"max logit diff {report.max_logit_diff:.2e}, loss diff {report.loss_diff:.2e}, max relative "
                    f"grad diff {grads} (tolerance {tol:.0e})")
        if not report.ok:
            failures = report.failures()
            raise AssertionError(f"{failures[0]} (+{len(failures) - 1} more); {measured}")
        return measured

    return Probe(f"{'packed-fp32' if fp32 else 'packed'}:{family}:{backend}", run)


def two_rank_probe(name: str, recipe: str, overrides: list[str]) -> Probe:
    def run(ctx: Context) -> str:
        if torch.cuda.device_count() < 2:
            raise Skipped(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        summary = train_run(ctx, recipe, name, 2, overrides, timeout=240)
        if summary["actual_steps"] != summary["estimated_steps"]:
            raise AssertionError(f"{summary['actual_steps']} steps, {summary['estimated_steps']} estimated")
        return (f"{recipe}: {summary['actual_steps']} steps on {summary['world_size']} ranks, "
                f"{summary['effective_tokens_per_s']:.0f} tokens/s")

    return Probe(name, run)


def flex_recompiles(family: str = "gemma3") -> Probe:
    def run(ctx: Context) -> str:
        from torch._dynamo.utils import counters

        from mvp_engine.engine.testing import collate_rows

        case = ctx.case(family)
        offered(case, "flex_attention")
        model = cuda_model(case, "flex_attention")
        torch._dynamo.reset()
        counters.clear()
        widths = []
        for pad in RECOMPILE_PADS:
            batch = with_metadata(case, model, collate_rows(case.rows, case.pad_token_id, extra_pad=pad))
            widths.append(batch["input_ids"].shape[1])
            packed_step(case, model, batch, "flex_attention")
        graphs = counters["stats"]["unique_graphs"]
        line = f"{graphs} compiled graphs over pack lengths {widths}"
        if graphs >= len(widths):
            raise AssertionError(f"{line}: every length compiles its own")
        return line

    return Probe(f"flex-recompiles:{family}", run)


def memory_probe(family: str, backend: str | None) -> Probe:
    def run(ctx: Context) -> str:
        case = ctx.case(family)
        chosen = backend or fastest_packed_backend(case)
        offered(case, chosen)
        model = cuda_model(case, chosen)
        batch = with_metadata(case, model, long_row(case))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        packed_step(case, model, batch, chosen)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return (f"{chosen}, bf16, one row of {batch['input_ids'].shape[1]} tokens: peak {peak / 2**30:.2f} GiB "
                f"({(peak - before) / 2**30:.2f} GiB over model + batch)")

    return Probe(f"memory-16k:{family}" + (f":{backend}" if backend else ""), run)


def host_syncs(family: str = "qwen2_vl") -> Probe:
    def run(ctx: Context) -> str:
        from mvp_engine.engine.testkit.host_syncs import counting_host_syncs

        case = ctx.case(family)
        backend = fastest_packed_backend(case)
        model = cuda_model(case, backend)
        batch = with_metadata(case, model, case.batch)
        packed_step(case, model, batch, backend)  # warm-up: lazy initialisation is not a step's cost
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, counting_host_syncs() as calls:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                packed_step(case, model, batch, backend)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        line = (f"{backend}: {syncs} synchronising CUDA calls in one packed micro-batch, as torch's sync debug mode "
                f"sees them (target <= {SYNC_TARGET}); the test kit's counter: {calls.total} calls, "
                f"{calls.from_project} from the project's code (target <= 4)")
        if syncs > SYNC_TARGET or calls.from_project > 4:
            raise AssertionError(line)
        return line

    return Probe(f"host-syncs:{family}", run)


def linear_attention_kernel(family: str = "qwen3_5") -> Probe:
    """fla's varlen gated delta rule (what packed linear attention runs on CUDA where flash-linear-attention is
    installed) against the exact torch reference per sample, on random inputs the shape of the family's layers."""

    def run(ctx: Context) -> str:
        from unittest import mock

        import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

        from mvp_engine.packing import flash_varlen_kwargs, linear_attention
        from mvp_engine.packing.linear_attention import CHUNK_RULE, _varlen_chunk_rule

        kernel, why = linear_attention.chunk_rule_kernel("cuda")
        if kernel != linear_attention.FLA_KERNEL:
            raise Skipped(why)
        original = getattr(modeling, CHUNK_RULE)  # transformers' own, under the wrapper a built model installed
        original = original.__wrapped__ if getattr(original, "_packs_by_boundaries", False) else original
        rule = _varlen_chunk_rule(original)
        generator = torch.Generator(device="cuda").manual_seed(0)
        segment_ids = torch.tensor([[0] * 300 + [1] * 700 + [2] * 24, [0] * 1000 + [-1] * 24])
        bounds = flash_varlen_kwargs(segment_ids.cuda())["cu_seq_lens_q"]
        shape = (2, segment_ids.shape[1], 4)
        q, k, v = (torch.randn(*shape, 64, device="cuda", generator=generator) for _ in range(3))
        g = -torch.rand(*shape, device="cuda", generator=generator) * 0.2
        beta = torch.rand(*shape, device="cuda", generator=generator)
        arguments = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
        with exact_fp32():
            fla, fla_states = rule(q, k, v, **arguments)
            with mock.patch.object(linear_attention, "fla_chunk_rule", lambda: None):
                reference, states = rule(q, k, v, **arguments)
        diff, state_diff = (fla - reference).abs().max().item(), (fla_states - states).abs().max().item()
        line = f"{why}: max |fla - reference| {diff:.2e} (outputs), {state_diff:.2e} (final states), fp32 inputs"
        if diff > BF16_TOL or state_diff > BF16_TOL:
            raise AssertionError(line)
        return line

    return Probe(f"linear-attention-fla:{family}", run)


def nccl_group_timeout() -> Probe:
    """``train.dist_timeout_s`` on the device mesh's own groups: NCCL takes its own options class
    (``parallel.group_timeout_options``), which the CPU's gloo tests cannot build."""

    def run(ctx: Context) -> str:
        from datetime import timedelta

        import torch.distributed as dist

        from mvp_engine.engine.parallel import group_timeout_options

        if not dist.is_nccl_available():
            raise Skipped("this torch has no NCCL")
        dist.init_process_group("nccl", init_method=f"file://{ctx.workdir / 'nccl_store'}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            options = group_timeout_options(77)
            group = dist.new_group([0], timeout=timedelta(seconds=77), pg_options=options)
            timeout = group._get_backend(torch.device("cuda")).options._timeout
            dist.barrier(group=group)
        finally:
            dist.destroy_process_group()
        if timeout != timedelta(seconds=77):
            raise AssertionError(f"the group waits {timeout}, not 77 s")
        return "an NCCL group made with the run's options waits the run's timeout (77 s)"

    return Probe("nccl-group-timeout", run)


def fused_losses(length: int = 4096, hidden_size: int = 256, vocab: int = 151936) -> Probe:
    """``train.loss_impl=liger`` / ``cce`` against ``chunked`` (gpu_losses.py): loss and the gradients of the
    hidden states and the head's weight on packed rows with per-sample weights (``sample``: the per-token upstream
    gradients Liger got wrong before 0.8.2), fp32 without TF32, within 1e-4 relative; each kernel's peak memory
    over the inputs beside chunked's. SKIP when neither package is installed."""
    def run(ctx: Context) -> str:
        from mvp_engine.engine import gpu_losses
        from mvp_engine.engine.config import ConfigError
        from mvp_engine.engine.linear_loss import chunked_token_loss, supervised_rows

        available = []
        for impl in gpu_losses.PACKAGES:
            try:
                gpu_losses._package(impl)
                available.append(impl)
            except ConfigError as err:
                missing = str(err)
        if not available:
            raise Skipped(missing)
        generator = torch.Generator(device="cuda").manual_seed(0)
        seg = torch.arange(length, device="cuda").div(length // 8, rounding_mode="floor").unsqueeze(0)
        labels = torch.randint(0, vocab, (1, length), device="cuda", generator=generator)
        labels[:, :: length // 8] = -100  # each sample's first position unsupervised
        head = torch.nn.Linear(hidden_size, vocab, bias=False, device="cuda")
        torch.nn.init.normal_(head.weight, std=hidden_size ** -0.5, generator=generator)
        hidden = torch.randn(1, length, hidden_size, device="cuda", generator=generator).requires_grad_()
        found, out = {}, []
        with exact_fp32():
            for impl in ("chunked", *available):
                hidden.grad = head.weight.grad = None
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if impl == "chunked":
                    part = chunked_token_loss(hidden, head, labels, seg, "sample")
                else:
                    rows, targets, _, flat = supervised_rows(hidden, labels)
                    part = gpu_losses.fused_token_loss(impl, rows, targets, flat, head, labels, seg, "sample", None,
                                                       None)
                loss = part.weighted_sum / part.weight_total
                loss.backward()
                torch.cuda.synchronize()
                found[impl] = (float(loss), hidden.grad.clone(), head.weight.grad.clone(),
                               (torch.cuda.max_memory_allocated() - before) / 2**20)
        reference = found["chunked"]
        worst = 0.0
        for impl in available:
            loss, grad_hidden, grad_weight, peak = found[impl]
            diffs = [abs(loss - reference[0]) / abs(reference[0]),
                     float((grad_hidden - reference[1]).abs().max() / reference[1].abs().max()),
                     float((grad_weight - reference[2]).abs().max() / reference[2].abs().max())]
            worst = max(worst, *diffs)
            out.append(f"{impl}: loss {diffs[0]:.1e}, grad hidden {diffs[1]:.1e}, grad weight {diffs[2]:.1e}, "
                       f"peak {peak:.0f} MiB")
        out.append(f"chunked peak {reference[3]:.0f} MiB ({length} x {vocab}, 8 samples, sample weights)")
        if worst > 1e-4:
            raise AssertionError("; ".join(out))
        return "; ".join(out)

    return Probe("fused-losses", run)


def train_probe(recipe: str, overrides: list[str]) -> Probe:
    def run(ctx: Context) -> str:
        summary = train_run(ctx, recipe, "train", 1, overrides, timeout=240)
        flops = summary.get("flops") or {}
        mfu = flops.get("mfu")
        return (f"{recipe} ({summary['attention']}): {summary['actual_steps']} steps, "
                f"{summary['effective_tokens_per_s']:.0f} tokens/s, {flops.get('tflops_per_s', 0):.3g} TFLOP/s, "
                f"MFU {'unknown: ' + str(flops.get('peak_source')) if mfu is None else f'{mfu:.2%}'}")

    return Probe(f"train:{recipe}", run)


def probes(train_recipe: str = "qwen2_vl", train_overrides: tuple[str, ...] = ()) -> list[Probe]:
    """Every probe, in the order they run: the first families' packed steps, the measurements, the 2-rank runs,
    then the other families."""
    def packed(families) -> list[Probe]:
        return ([packed_probe(f, b, torch.bfloat16) for f in families for b in BF16_BACKENDS]
                + [packed_probe(f, b, torch.float32) for f in families for b in FP32_BACKENDS])

    return [*packed(FAMILIES[:3]), flex_recompiles(), memory_probe("qwen2_vl", None),
            memory_probe("gemma3", "flex_attention"), host_syncs(), linear_attention_kernel(), nccl_group_timeout(),
            fused_losses(),
            train_probe(train_recipe, list(train_overrides)),
            two_rank_probe("cp2", "qwen2_5_vl", ["train.context_parallel_size=2"]),
            two_rank_probe("fsdp2-2ranks", "qwen2_vl", ["train.sharding=fsdp2"]), *packed(FAMILIES[3:])]


# --------------------------------------------------------------------------------------------------------- main


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_probe(probe: Probe, ctx: Context) -> str:
    """One probe, isolated: its verdict line (what it raised is its MISS reason); CUDA memory freed after it."""
    started = time.perf_counter()
    try:
        verdict, detail = "OK", probe.run(ctx)
    except Skipped as skip:
        verdict, detail = "SKIP", str(skip)
    except Exception as err:  # noqa: BLE001 - a failing probe is one MISS line, the next probe still runs
        verdict, detail = "MISS", first_line(err)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return f"{verdict:<5}{probe.name:<36}{detail} [{time.perf_counter() - started:.1f} s]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the probe names and exit")
    parser.add_argument("--only", action="append", default=[], help="run probes whose name starts with this")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="probes not started by then print SKIP")
    parser.add_argument("--train-recipe", default="qwen2_vl", help="the recipe of the train probe")
    parser.add_argument("--train-override", action="append", default=[], help="a key=value of the train probe")
    args = parser.parse_args(argv)
    chosen = [p for p in probes(args.train_recipe, tuple(args.train_override))
              if not args.only or p.name.startswith(tuple(args.only))]
    if args.list:
        print("\n".join(p.name for p in chosen))
        return 0
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    print(f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}, "
          f"flash_attn {'installed' if importlib.util.find_spec('flash_attn') else 'not installed'}", flush=True)
    started, counts = time.perf_counter(), {"OK": 0, "MISS": 0, "SKIP": 0}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        ctx = Context(Path(workdir))
        for probe in chosen:
            spent = time.perf_counter() - started
            line = (f"{'SKIP':<5}{probe.name:<36}time budget spent ({spent:.0f} s of {args.budget_s:.0f} s)"
                    if spent > args.budget_s else run_probe(probe, ctx))
            counts[line.split()[0]] += 1
            print(line, flush=True)
    print(json.dumps(counts), f"in {time.perf_counter() - started:.0f} s")
    return 1 if counts["MISS"] else 0


if __name__ == "__main__":
    sys.exit(main())
