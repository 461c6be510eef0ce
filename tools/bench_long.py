"""Packed attention at long sequence lengths: one packed row per attention backend, step time and peak added memory.

Why: a packed row is only as cheap as its attention. eager and sdpa pack through a dense (1, 1, L, L) block-causal
mask, so their cost grows with L^2 although the useful work is the sum of the squared segment lengths; a varlen
backend (``sdpa_varlen`` on CPU, flash on CUDA) should cost what the segments cost one by one, and its memory should
grow linearly in L. This measures exactly that on the language model path of the real Qwen2-VL recipe: the
recipe's ``build_model`` with a config bumped by overrides (the tiny test model is too small for attention to show),
rows built by the DataKit (``MLLMPack`` / ``MLLMCollator``) as training builds them, kwargs from the recipe's
``prepare_packed`` for the backend under test.

What is measured, per (backend, L), in a fresh process: one training step = ``prepare_packed`` + forward + token
loss (``weighted_token_loss``) + backward. Its time: the best of ``--repeats`` timed steps after one untimed warm-up
step. Its peak added memory: the process RSS, sampled every 5 ms by a background thread (psutil) during the
process's first step, minus the RSS just before that step. The reference, once per L: the same segments one by
one, each alone and unpacked through the recipe's ``prepare_padded`` on a one-row batch with sdpa (what a padded
Hugging Face run does), measured the same way, a pass over all segments counting as one step (the sum of the
per-segment steps).

Fairness, and why each choice:

- The same segments for every L and every backend: segment lengths are one fixed-seed stream (log-normal, median
  ``--segment-median`` 700 tokens, ``--segment-sigma`` 0.5, so most lie in about 300..1500; capped to
  ``--max-segment`` and to L, at least 32), and the row of length L takes the stream's first segments, the last one
  cut to fill the row exactly (a cut that would leave fewer than 32 tokens gives them to that segment). So a longer
  row holds the shorter row's segments plus more of the same mix, and memory should grow linearly in L. Token ids
  are random (seeded) ordinary ids of the vocabulary: text-only rows, no image tokens; labels = input ids.
- The same work on both sides: the reference steps run on the packed row's own samples and weights; each segment's
  loss is divided by the supervised tokens of the whole row, so the accumulated gradients equal the packed step's.
  Both sides include building their model kwargs: eager's and sdpa's dense mask is built in ``prepare_packed`` and
  is part of what packing costs them. Gradients are set to None before every packed step and every one-by-one pass,
  as an optimizer's ``zero_grad`` does, so both allocate them inside the measured step.
- Memory needs a fresh process and an allocator that gives memory back. A process that has already run steps
  keeps freed memory mapped, and a later step reusing it shows no RSS growth, hiding its peak; so each measurement
  is its own process, forked from a multiprocessing ``forkserver`` that has only imported the modules (the ~10 s
  of imports are paid once). Within a process glibc does the same: its mmap threshold grows to 32 MiB and freed
  activations stay in the heap (measured at L=4096 on ``sdpa_varlen``, three steps in a row: 384, 236 and 195 MiB
  added). So every measuring process first fixes glibc's mmap and trim thresholds at 128 KiB (``mallopt``, before
  the model is built): freed blocks go straight back, RSS follows live memory (the same three steps: 354, 332,
  333 MiB). The memory step is the first one, so it includes first-step one-off allocations (about 20 MiB,
  measured), alike for every backend and the reference.
- Time needs the allocator of a training process in its steady state: the fixed thresholds make every large
  block a fresh mapping that is page-faulted again at every step (steps 20-45 % slower, measured at 4096 and
  8192). After the memory step the thresholds are set to where glibc's dynamic ones settle (mmap 32 MiB, trim 64
  MiB), one warm-up step refills the heap, then the timed steps run, with no sampler thread.
- A measurement that fails is a row, not a crash: an exception in the step (``MemoryError``, the allocator's
  RuntimeError), RSS over ``--memory-limit-gib`` (default 16; the parent watches the child's RSS every 10 ms and
  kills it), a measurement over ``--timeout-s`` (default 600, all of it: model, memory step, warm-up, repeats; a
  dense L x L step at 32768 tokens takes minutes on one thread; a measurement whose other steps would pass the
  limit at its first step's pace stops after that step instead of being killed later) or a process killed by the
  kernel. A backend that failed at some L is not run at larger L (it would fail again).
- ``--threads`` (default 1) fixes torch's intra-op threads in every measuring process: with two OpenMP threads on
  two cores shared with other processes (and with the RSS sampler and the parent's watchdog), every parallel
  region waits for a descheduled thread and steps became 10-20x slower at random (measured in
  ``tools/bench_train.py``), which swamps the differences measured here. All compared numbers use the same count.
- fp32 on CPU, the model in train mode (its dropout is 0), the same seeded weights in every process.

Targets, for ``--default-backend`` (default ``sdpa_varlen``), each printed with its measured value and OK/MISS; a
failed or missing measurement is a MISS:

1. at the largest L requested, peak added memory <= 2.5 GiB;
2. memory grows linearly in L: with L_min and L_max the smallest and largest L requested,
   ``peak(L_max) / peak(L_min) <= 1.5 * (L_max / L_min)``. Fixed costs (gradients, the model's per-step buffers)
   make the left side smaller than L_max / L_min, a dense L x L term makes it up to (L_max / L_min)^2 (64 for
   4096 -> 32768); the 1.5 is slack for sampling noise. It needs two lengths (else MISS);
3. at every L requested, step time <= 1.3 x the sum of the one-by-one steps.

    python tools/bench_long.py [--lengths 4096 8192 16384 32768] [--backends eager sdpa sdpa_varlen]
        [--hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2] [--repeats 2] [--threads 1]
        [--memory-limit-gib 16] [--timeout-s 600] [--default-backend sdpa_varlen] [--json PATH]

``--recipe gemma3`` / ``gemma4``: the same on a Gemma language model (layers alternating sliding and full, ending
full, window ``--sliding-window`` 512), each segment holding one 64-token bidirectional block per 256 tokens in its
token types (as an image's soft tokens; no pixels), so ``sdpa_varlen`` trains with per-span masks (a span longer
than the window or holding a block gets its own n x n mask) and ``flex_attention`` takes the BlockMask built from
tiles; ``--forward-only`` runs flex forward only on CPU (compiled by transformers; no backward there). One more
target where 8192 and 32768 both run: (4) peak(32768) <= 4.5 x peak(8192), no L x L term anywhere.

    python tools/bench_long.py --recipe gemma4 --backends sdpa_varlen flex_attention --forward-only --repeats 1

``--context-parallel N`` (N > 1) measures context parallelism instead: per (backend, L), one packed row whose
segments each open with one image per 256 tokens (16 x 16 patches, 64 placeholder tokens: pages of a document),
trained once unsplit (CP = 1) and once split over N gloo ranks started here (``torch.multiprocessing``, a file
rendezvous; the engine's ``sequence_parallel_forward``: Ulysses attention, the vision work by share), each in its
own processes with the same seeded weights. Per rank, exactly: the bytes autograd saves for backward over the
forward and the loss (``SavedForBackward``, as ``tools/bench_memory.py``), the FLOPs inside the vision tower
(``FlopCounterMode``, module ``model.visual``) and the step time (best of ``--repeats`` after a warm-up, between
barriers); the worst rank counts. Targets: at L = 8192 (else the longest L), CP = N's per-rank saved bytes <= 0.6x
CP = 1's and its vision FLOPs per rank <= 0.6x (images are encoded whole, so a short row of a few images cannot split
evenly: other lengths are printed, not judged); with several lengths, CP = N's saved bytes grow linearly.

    python tools/bench_long.py --lengths 4096 8192 --backends sdpa_varlen --context-parallel 2

``--backends`` defaults to every backend the recipe offers (its ``Recipe.attention_backends``); those
this machine cannot train with (``check_attention``: flash needs CUDA and flash_attn) are skipped with the reason
printed. Progress goes to stderr, the table and the targets to stdout. ``main(argv)`` returns what it printed as a
dict; the numbers come from functions returning data (``run_all``, ``targets_for``), ``report`` only formats them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing
import os
import random
import runpy
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from mvp_engine.engine.config import ConfigError, backward_available, check_attention, compose_config
from mvp_engine.engine.context_parallel import sequence_parallel_forward
from mvp_engine.engine.loss import weighted_token_loss
from mvp_engine.engine.participation import media_kinds
from mvp_engine.engine.recipe import Recipe, load_recipe
from mvp_engine.engine.recompute import SavedForBackward
from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMCollator, MLLMPack, MLLMSample
from mvp_engine.packing import SequenceShard, enable_ulysses

RECIPE = "qwen2_vl"  # the default; --recipe picks another (context parallelism runs on this one)
RECIPES = ("qwen2_vl", "gemma3", "gemma4")
BLOCK_EVERY, BLOCK_TOKENS = 256, 64  # Gemma rows: per 256 tokens of a segment one 64-token bidirectional block
DEFAULT_SLIDING_WINDOW = 512  # Gemma rows: the sliding layers' window (Gemma 4's smaller checkpoints)
LONG_GROWTH = (8192, 32768, 4.5)  # (4): peak(32768) <= 4.5 x peak(8192), where both lengths run
REFERENCE = "one-by-one"
REFERENCE_BACKEND = "sdpa"
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)

TARGET_PEAK_GIB = 2.5
TARGET_GROWTH_SLACK = 1.5
TARGET_STEP_RATIO = 1.3

MIN_SEGMENT = 32
GIB = 2**30
MIB = 2**20
SAMPLE_EVERY_S = 0.005  # RSS sampling period inside the measuring process
WATCH_EVERY_S = 0.01  # the parent's RSS / time-limit check of the measuring process
FIXED_MALLOC_THRESHOLD = 128 * 1024  # while measuring memory: freed blocks >= 128 KiB go back to the system
SETTLED_MMAP_THRESHOLD, SETTLED_TRIM_THRESHOLD = 32 * MIB, 64 * MIB  # where glibc's dynamic thresholds end up
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)

WORKER_RUN_NAME = "__bench_long_worker__"
# imported once by the forkserver, so each measuring process starts with them loaded
PRELOAD = ["psutil", "torch", "transformers", "omegaconf", "mvp_engine.engine.config", "mvp_engine.engine.loss",
           "mvp_engine.engine.recipe", "mvp_engine.kit.mllm.data", *(f"recipes.{name}.train" for name in RECIPES)]


# ------------------------------------------------------------------------------------------ rows and the model


def segment_lengths(length: int, median: float, sigma: float, max_segment: int, seed: int) -> list[int]:
    """The row's segments: the first draws of one seeded log-normal stream, the last cut to fill ``length``."""
    rng = random.Random(seed)
    cap = min(max_segment, length)
    out: list[int] = []
    while sum(out) < length:
        n = min(cap, max(MIN_SEGMENT, round(rng.lognormvariate(math.log(median), sigma))))
        left = length - sum(out)
        if left - n < MIN_SEGMENT:  # cut to fill the row exactly, never leaving a sliver behind
            n = left
        out.append(n)
    return out


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's (temporal, height, width) rotary split of ``head_dim / 2``, in its released 16:24:24 proportion."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def model_overrides(args: argparse.Namespace) -> list[str]:
    """Hydra overrides bumping the recipe's tiny language model to the benchmark's sizes (fp32, seeded); Gemma:
    sliding layers and full ones alternating, ending full, with ``--sliding-window``."""
    text = "model.config.text_config"
    head_dim = args.hidden // args.heads
    common = [f"{text}.hidden_size={args.hidden}", f"{text}.intermediate_size={args.intermediate}",
              f"{text}.num_hidden_layers={args.layers}", f"{text}.num_attention_heads={args.heads}",
              f"{text}.num_key_value_heads={args.kv_heads}",
              f"{text}.max_position_embeddings={max(4096, *args.lengths)}", "model.dtype=float32",
              f"model.seed={args.seed}"]
    if args.recipe == "qwen2_vl":
        section = ",".join(str(s) for s in mrope_section(head_dim))
        return [*common, f"{text}.rope_parameters.mrope_section=[{section}]"]
    kinds = ",".join("full_attention" if (args.layers - 1 - i) % 2 == 0 else "sliding_attention"
                     for i in range(args.layers))
    gemma = [*common, f"{text}.head_dim={head_dim}", f"{text}.layer_types=[{kinds}]",
             f"{text}.sliding_window={args.sliding_window}"]
    if args.recipe == "gemma4":
        gemma.append(f"{text}.global_head_dim={2 * head_dim}")
    else:
        gemma.append(f"{text}.query_pre_attn_scalar={head_dim}")
    return gemma


def model_config(args: argparse.Namespace) -> dict:
    """The recipe's model config with the overrides, as a plain dict (it travels to the measuring processes)."""
    return OmegaConf.to_container(compose_config(args.recipe, model_overrides(args)).model, resolve=True)


def ordinary_token_ids(config) -> torch.Tensor:
    """Vocabulary ids that are not image / video / vision markers (those would need media): every ``*_token_id`` /
    ``*_token_index`` of the config and the pad id left out."""
    text = config.get_text_config()
    special = {value for key, value in config.to_dict().items()
               if key.endswith(("_token_id", "_token_index")) and isinstance(value, int)} | {text.pad_token_id}
    return torch.tensor([i for i in range(text.vocab_size) if i not in special])


def make_samples(lengths: list[int], config, seed: int, type_field: str | None = None) -> list[MLLMSample]:
    """Text-only samples of the given lengths, seeded random ordinary ids, labels = input ids; with ``type_field``
    (Gemma's token types) each ``BLOCK_EVERY`` tokens of a segment hold a ``BLOCK_TOKENS`` run of type 1, a
    bidirectional block as an image's soft tokens are (no pixels: the masks are what is measured)."""
    ids = ordinary_token_ids(config)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index, n in enumerate(lengths):
        tokens = ids[torch.randint(len(ids), (n,), generator=generator)]
        fields = {}
        if type_field:
            types = torch.zeros(n, dtype=torch.long)
            for start in range(16, n - BLOCK_TOKENS, BLOCK_EVERY):
                types[start:start + BLOCK_TOKENS] = 1
            fields[type_field] = types
        samples.append(MLLMSample(input_ids=tokens, labels=tokens.clone(), sample_id=f"seg{index}",
                                  token_fields=fields))
    return samples


def collate(samples: list[MLLMSample], pad_token_id: int) -> dict:
    """One row holding ``samples``, packed and collated by the DataKit as training does (no padding)."""
    return MLLMCollator(pad_token_id=pad_token_id)([MLLMPack(samples).to_model_inputs()])


def supervised_targets(batch: dict) -> int:
    """Shifted targets the token loss counts (the first label of every segment is ignored by ``MLLMPack``)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------ inside a measuring process


class PeakRss:
    """RSS of this process just before the block (``baseline``) and its peak during it, sampled by a thread."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self.baseline = self.peak = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def added(self) -> int:
        return self.peak - self.baseline


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's mmap threshold (blocks at least this big get their own mapping, unmapped when freed) and trim threshold
    (free heap top kept up to this); False where there is no glibc ``mallopt``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes) and libc.mallopt(M_TRIM_THRESHOLD, trim_bytes))
    except (OSError, AttributeError):
        return False


def packed_step(recipe: Recipe, model, batch: dict, backend: str, forward_only: bool = False) -> None:
    """prepare_packed + forward + token-mean loss + backward of the packed row (``forward_only``: no backward, no
    graph kept: a backend that cannot train on this machine, flex on CPU)."""
    with torch.set_grad_enabled(not forward_only):
        logits = model(**recipe.prepare_packed(batch, model, backend)).logits
        loss = weighted_token_loss(logits, batch["labels"], batch["pack_segment_ids"], "token")
        if not forward_only:
            (loss.weighted_sum / loss.weight_total).backward()


def one_by_one_pass(recipe: Recipe, model, batches: list[dict], total_targets: int) -> float:
    """Every segment alone (prepare_padded + forward + loss + backward, gradients accumulating); summed step time."""
    seconds = 0.0
    for batch in batches:
        start = time.perf_counter()
        logits = model(**recipe.prepare_padded(batch, model, REFERENCE_BACKEND)).logits
        loss = weighted_token_loss(logits, batch["labels"], batch["pack_segment_ids"], "token")
        (loss.weighted_sum / total_targets).backward()
        seconds += time.perf_counter() - start
        del logits, loss
    return seconds


def check_time_left(first_s: float, steps_left: int, started: float, timeout_s: float) -> None:
    """Stop now when the steps left, at the first step's pace, would run past the limit (the parent would kill us)."""
    expected = time.monotonic() - started + steps_left * first_s
    if timeout_s and expected > timeout_s:
        raise TimeoutError(f"first step took {first_s:.1f} s, {steps_left} more would pass the --timeout-s "
                           f"{timeout_s:g} s limit (about {expected:.0f} s in all), stopped")


def measured_runs(model, run, repeats: int, started: float, timeout_s: float) -> dict:
    """``run() -> seconds`` (one step or one one-by-one pass), each time with fresh gradients: first under the fixed
    small malloc thresholds with RSS sampled (the memory), then under glibc's settled thresholds one untimed warm-up
    and ``repeats`` timed runs without the sampler (the time)."""
    model.zero_grad(set_to_none=True)
    with PeakRss() as rss:
        memory_step_s = run()
    check_time_left(memory_step_s, 1 + repeats, started, timeout_s)
    settled = set_malloc_thresholds(SETTLED_MMAP_THRESHOLD, SETTLED_TRIM_THRESHOLD)
    times = []
    for _ in range(1 + repeats):
        model.zero_grad(set_to_none=True)
        times.append(run())
    return {"step_s": min(times[1:]), "times_s": times[1:], "warmup_s": times[0], "peak_added_bytes": rss.added,
            "baseline_rss_bytes": rss.baseline, "memory_step_s": memory_step_s, "malloc_thresholds_set": settled}


def run_spec(spec: dict) -> dict:
    """Build the model and the row(s) of ``spec``, then measure the packed step or the one-by-one pass."""
    started = time.monotonic()
    # before anything is allocated, so no block freed by the model build is reused unseen by the memory step
    fixed = set_malloc_thresholds(FIXED_MALLOC_THRESHOLD, FIXED_MALLOC_THRESHOLD)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    reference = spec["backend"] == REFERENCE
    backend = REFERENCE_BACKEND if reference else spec["backend"]
    recipe = load_recipe(spec["recipe"])
    model = recipe.build_model(spec["model_cfg"], backend).train()
    pad = model.config.get_text_config().pad_token_id
    samples = make_samples(spec["segments"], model.config, spec["seed"],
                           getattr(recipe.build_encoder, "token_type_field", None))
    row = collate(samples, pad)
    if reference:
        alone = [collate([sample], pad) for sample in samples]
        total = supervised_targets(row)
        result = measured_runs(model, lambda: one_by_one_pass(recipe, model, alone, total), spec["repeats"],
                               started, spec["timeout_s"])
    else:
        def timed_step() -> float:
            start = time.perf_counter()
            packed_step(recipe, model, row, backend, spec["forward_only"])
            return time.perf_counter() - start
        result = measured_runs(model, timed_step, spec["repeats"], started, spec["timeout_s"])
    result["malloc_thresholds_set"] = fixed and result["malloc_thresholds_set"]
    return {**result, "threads": torch.get_num_threads(),
            "tokens": int(row["input_ids"].numel())}


def worker(spec: dict, result_path: str, log_path: str) -> None:
    """Entry of a measuring process: its output goes to ``log_path``, its result (or error) to ``result_path``."""
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    error = None
    try:
        result = run_spec(spec)
    except Exception as err:  # MemoryError, the allocator's RuntimeError, anything: a failed measurement
        message = (str(err).strip().splitlines() or [""])[0]
        error = f"{type(err).__name__}: {message}" if message else type(err).__name__
    if error is not None:  # outside the except block: the traceback (and the step's tensors) are gone by now
        result = {"error": error}
    Path(result_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ the parent


def worker_context():
    """A forkserver that imported the heavy modules once; each measurement forks a fresh process from it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip() if lines else ""


def watch(process, limit_bytes: int, timeout_s: float) -> str | None:
    """Wait for ``process``; kill it (and say why) when its RSS passes ``limit_bytes`` or it runs past the limit."""
    try:
        handle = psutil.Process(process.pid)
    except psutil.NoSuchProcess:
        handle = None
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    while process.is_alive():
        try:
            rss = handle.memory_info().rss if handle else 0
        except psutil.NoSuchProcess:
            rss = 0
        reason = None
        if rss > limit_bytes:
            reason = f"RSS {rss / GIB:.1f} GiB over the --memory-limit-gib {limit_bytes / GIB:g} limit, killed"
        elif time.monotonic() > deadline:
            reason = f"over the --timeout-s {timeout_s:g} s limit, killed"
        if reason:
            process.kill()
            process.join()
            return reason
        process.join(WATCH_EVERY_S)
    return None


def measure(context, spec: dict, args: argparse.Namespace, workdir: Path) -> dict:
    """Run one measurement in a fresh process and return its numbers, or ``{"error": reason}``."""
    tag = f"{spec['backend']}-{len(spec['segments'])}-{sum(spec['segments'])}"
    result_path, log_path = workdir / f"{tag}.json", workdir / f"{tag}.log"
    # runpy.run_path re-runs this file by path in the new process (its imports are preloaded), so the worker is found
    # however this module was loaded (as a script, by path in a test, or imported)
    process = context.Process(target=runpy.run_path, args=(str(Path(__file__).resolve()),),
                              kwargs={"init_globals": {"WORKER_ARGS": (spec, str(result_path), str(log_path))},
                                      "run_name": WORKER_RUN_NAME})
    process.start()
    reason = watch(process, int(args.memory_limit_gib * GIB), args.timeout_s)
    if reason is None and result_path.exists():
        return json.loads(result_path.read_text())
    if reason is None:
        code = process.exitcode
        cause = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if code == -9:
            cause += " (out of memory?)"
        reason = f"{cause}; {last_line(log_path)}".rstrip("; ")
    return {"error": reason}


def runnable_backends(requested: list[str], recipe: str = RECIPE,
                      forward_only: bool = False) -> tuple[list[str], dict[str, str]]:
    """The backends of ``requested`` this recipe and machine can train with (``forward_only``: or run forward, as
    flex on CPU), and why each other one is skipped."""
    offered = load_recipe(recipe).attention_backends
    runnable, skipped = [], {}
    for name in dict.fromkeys(requested):
        try:
            check_attention(name, offered, training=not forward_only)
            runnable.append(name)
        except ConfigError as err:
            skipped[name] = str(err)
    return runnable, skipped


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_all(lengths: list[int], backends: list[str],
            measure_one: Callable[[str, int], dict]) -> tuple[list[dict], dict[int, dict]]:
    """Every length: the one-by-one reference, then each backend (``measure_one(name, length)``); a name that failed
    at some L is not run at larger L (it would fail again). Each row's ratio is its step over the reference's."""
    rows, references, failed_at = [], {}, {}
    for length in lengths:
        for name in (REFERENCE, *backends):
            if name in failed_at:
                result = {"error": f"not run: failed at L={failed_at[name]} already"}
            else:
                result = measure_one(name, length)
            if "error" in result:
                failed_at.setdefault(name, length)
            entry = {"backend": name, "length": length, **result}
            if name == REFERENCE:
                references[length] = entry
            else:
                rows.append(entry)
    for row in rows:
        reference = references[row["length"]]
        ok = "error" not in row and "error" not in reference
        row["ratio"] = row["step_s"] / reference["step_s"] if ok and reference["step_s"] > 0 else None
    return rows, references


def measure_all(args: argparse.Namespace, model_cfg: dict, backends: list[str],
                segments: dict[int, list[int]]) -> tuple[list[dict], dict[int, dict]]:
    """``run_all`` with each measurement in its own process forked from one forkserver, progress on stderr."""
    context = worker_context()
    with tempfile.TemporaryDirectory(prefix="bench_long-") as tmp:
        def measure_one(name: str, length: int) -> dict:
            spec = {"model_cfg": model_cfg, "segments": segments[length], "threads": args.threads,
                    "repeats": args.repeats, "seed": args.seed, "timeout_s": args.timeout_s, "backend": name,
                    "recipe": args.recipe,
                    "forward_only": name != REFERENCE and not backward_available(name, "cpu")}
            progress(f"measuring {name} at L={length} ...")
            started = time.perf_counter()
            result = measure(context, spec, args, Path(tmp))
            progress(f"  done in {time.perf_counter() - started:.1f} s"
                     + (f": failed: {result['error']}" if "error" in result else ""))
            return result

        return run_all(args.lengths, backends, measure_one)


# --------------------------------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISS"


def find_row(rows: list[dict], backend: str, length: int) -> dict | None:
    return next((r for r in rows if r["backend"] == backend and r["length"] == length), None)


def failure(row: dict | None, skipped: dict[str, str], backend: str, length: int) -> str | None:
    """Why there is no number for (backend, L), or None when there is one."""
    if row is None:
        return f"{backend} not measured" + (f" ({skipped[backend]})" if backend in skipped else "")
    if "error" in row:
        return f"{backend} failed at L={length}: {row['error']}"
    return None


def target_peak(rows, skipped, backend, lengths) -> dict:
    length = max(lengths)
    row = find_row(rows, backend, length)
    why = failure(row, skipped, backend, length)
    value = None if why else row["peak_added_bytes"] / GIB
    ok = value is not None and value <= TARGET_PEAK_GIB
    shown = why or f"{value:.3f} GiB"
    return {"name": "peak", "value": value, "limit": TARGET_PEAK_GIB, "ok": ok,
            "line": f"(1) peak added memory at L={length} <= {TARGET_PEAK_GIB} GiB: {shown} -> {verdict(ok)}"}


def target_growth(rows, skipped, backend, lengths) -> dict:
    low, high = min(lengths), max(lengths)
    bound = TARGET_GROWTH_SLACK * high / low
    head = f"(2) linear memory growth: peak(L={high}) / peak(L={low}) <= {TARGET_GROWTH_SLACK} x {high}/{low}"
    if low == high:
        return {"name": "growth", "value": None, "limit": bound, "ok": False,
                "line": f"{head} = {bound:.2f}: needs two lengths -> MISS"}
    rows_at = {length: find_row(rows, backend, length) for length in (low, high)}
    why = next((w for length, r in rows_at.items() if (w := failure(r, skipped, backend, length))), None)
    value = None
    if why is None and rows_at[low]["peak_added_bytes"] > 0:
        value = rows_at[high]["peak_added_bytes"] / rows_at[low]["peak_added_bytes"]
    elif why is None:
        why = f"peak at L={low} is {rows_at[low]['peak_added_bytes']} bytes, no ratio"
    ok = value is not None and value <= bound
    shown = why or f"{value:.3f}"
    return {"name": "growth", "value": value, "limit": bound, "ok": ok,
            "line": f"{head} = {bound:.2f}: {shown} -> {verdict(ok)}"}


def target_step(rows, references, skipped, backend, lengths) -> dict:
    per_length, problems = {}, []
    for length in lengths:
        row = find_row(rows, backend, length)
        why = failure(row, skipped, backend, length) or failure(references[length], {}, REFERENCE, length)
        if why:
            problems.append(why)
        else:
            per_length[length] = row["ratio"]
    value = max(per_length.values()) if per_length else None
    ok = not problems and value is not None and value <= TARGET_STEP_RATIO
    parts = [f"L={length} {ratio:.3f}x" for length, ratio in per_length.items()] + problems
    worst = "" if value is None else f"; worst {value:.3f}x"
    return {"name": "step", "value": value, "per_length": per_length, "limit": TARGET_STEP_RATIO, "ok": ok,
            "line": f"(3) step <= {TARGET_STEP_RATIO}x the sum of one-by-one steps at every L: {', '.join(parts)}"
                    f"{worst} -> {verdict(ok)}"}


def target_long_growth(rows, skipped, backend) -> dict:
    """(4) peak(32768) <= 4.5 x peak(8192): no L x L term anywhere (4x the tokens, 4x the memory, and some slack)."""
    low, high, bound = LONG_GROWTH
    head = f"(4) peak(L={high}) <= {bound} x peak(L={low})"
    rows_at = {length: find_row(rows, backend, length) for length in (low, high)}
    why = next((w for length, r in rows_at.items() if (w := failure(r, skipped, backend, length))), None)
    value = None if why or not rows_at[low]["peak_added_bytes"] else (rows_at[high]["peak_added_bytes"]
                                                                      / rows_at[low]["peak_added_bytes"])
    ok = value is not None and value <= bound
    shown = why or ("no peak at L=8192" if value is None else f"{value:.3f}x")
    return {"name": "long_growth", "value": value, "limit": bound, "ok": ok,
            "line": f"{head}: {shown} -> {verdict(ok)}"}


def format_row(row: dict) -> str:
    head = f"{row['backend']:<18s} {row['length']:>6d}"
    if "error" in row:
        return f"{head}  failed: {row['error']}"
    ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.3f}"
    return f"{head} {row['step_s']:>10.4f} {row['peak_added_bytes'] / MIB:>15.1f} {ratio:>18s}"


def header_lines(args, model_cfg, backends, skipped, segments) -> list[str]:
    text = model_cfg["config"]["text_config"]
    sizes = (f"hidden {text['hidden_size']}, intermediate {text['intermediate_size']}, layers "
             f"{text['num_hidden_layers']}, heads {text['num_attention_heads']} (kv {text['num_key_value_heads']})")
    if "sliding_window" in text:
        sizes += (f", layers {','.join(kind.split('_')[0] for kind in text['layer_types'])}, window "
                  f"{text['sliding_window']}; token types: a {BLOCK_TOKENS}-token bidirectional block per "
                  f"{BLOCK_EVERY} tokens")
    lines = [f"recipe {args.recipe} language model: {sizes}, fp32 on CPU, torch threads "
             f"{args.threads or torch.get_num_threads()}; one packed row per (backend, L); step = prepare + forward + "
             f"token loss + backward, best of {args.repeats} after 1 warm-up; peak = RSS peak - RSS before the step, "
             f"fresh process each; limits {args.memory_limit_gib:g} GiB, {args.timeout_s:g} s",
             f"segments: log-normal median {args.segment_median:g} sigma {args.segment_sigma:g}, {MIN_SEGMENT}.."
             f"{args.max_segment} tokens, seed {args.seed}, the last cut to fill the row; {REFERENCE} = each segment "
             f"alone through prepare_padded on {REFERENCE_BACKEND}, step = sum of the segments' steps"]
    for length, lengths in segments.items():
        lines.append(f"  L={length}: {len(lengths)} segments, {min(lengths)}..{max(lengths)} tokens "
                     f"(mean {sum(lengths) / len(lengths):.0f})")
    lines.append(f"backends: {', '.join(backends) or 'none'}"
                 + "".join(f"; {name} forward only (no backward here)" for name in backends
                           if not backward_available(name, "cpu")))
    lines += [f"skipped {name}: {reason}" for name, reason in skipped.items()]
    return lines


def targets_for(backend: str, rows: list[dict], references: dict[int, dict], skipped: dict[str, str],
                lengths: list[int]) -> list[dict]:
    """The three targets of ``backend``, each with its value, its limit and its verdict."""
    return [target_peak(rows, skipped, backend, lengths), target_growth(rows, skipped, backend, lengths),
            target_step(rows, references, skipped, backend, lengths)]


def report(args, model_cfg, backends, skipped, segments, rows, references, seconds) -> dict:
    """The header, the table and the targets as lines, with every number behind them."""
    lines = header_lines(args, model_cfg, backends, skipped, segments)
    lines.append(f"{'backend':<18s} {'L':>6s} {'step s':>10s} {'peak added MiB':>15s} {'step / one-by-one':>18s}")
    for length in args.lengths:
        lines.append(format_row({**references[length], "ratio": None}))
        lines += [format_row(r) for r in rows if r["length"] == length]
    backend = args.default_backend
    targets = targets_for(backend, rows, references, skipped, args.lengths)
    if {LONG_GROWTH[0], LONG_GROWTH[1]} <= set(args.lengths):
        targets.append(target_long_growth(rows, skipped, backend))
    lines.append(f"targets for {backend}:")
    lines += [f"  {t['line']}" for t in targets]
    lines.append(f"bench time {seconds:.1f} s")
    return {"recipe": args.recipe, "model": model_cfg["config"]["text_config"], "args": vars(args),
            "backends": backends,
            "skipped": skipped, "segments": {str(k): v for k, v in segments.items()}, "rows": rows,
            "references": [references[length] for length in args.lengths], "default_backend": backend,
            "targets": targets, "ok": all(t["ok"] for t in targets), "seconds": seconds, "lines": lines}


# ------------------------------------------------------------------ context parallelism (--context-parallel N)

CP_TARGET_LENGTH = 8192
CP_TARGET_SAVED = 0.6
CP_TARGET_VISION = 0.6
IMAGE_GRID = (1, 16, 16)  # patches of each image: 256, i.e. 64 placeholder tokens after the 2x2 merge
TOKENS_PER_IMAGE = 256  # a segment of n tokens opens with n // 256 images (at least one): ~25 % image tokens


def image_samples(lengths: list[int], config, seed: int) -> list[MLLMSample]:
    """``make_samples``' segments, each opening with one image per ``TOKENS_PER_IMAGE`` of its tokens (vision
    start, the placeholders, vision end; seeded random patches; pages of a document, frames of a clip) and
    supervising its text: a packed row with images, cut between CP ranks wherever the lengths put it."""
    vision = config.vision_config
    merged = math.prod(IMAGE_GRID) // vision.spatial_merge_size ** 2
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    image = torch.tensor([config.vision_start_token_id] + [config.image_token_id] * merged
                         + [config.vision_end_token_id])
    generator = torch.Generator().manual_seed(seed + 1)
    samples = []
    for sample in make_samples([max(n, merged + 8) for n in lengths], config, seed):
        count = max(1, sample.length // TOKENS_PER_IMAGE)
        head = 1 + count * len(image)
        ids = torch.cat([sample.input_ids[:1], image.repeat(count), sample.input_ids[head:]])
        labels = ids.clone()
        labels[:head] = IGNORE_INDEX
        media = {"pixel_values": torch.randn(count * math.prod(IMAGE_GRID), patch_values, generator=generator),
                 "image_grid_thw": torch.tensor([IMAGE_GRID] * count)}
        samples.append(MLLMSample(input_ids=ids, labels=labels, sample_id=sample.sample_id, media=media,
                                  num_media=count, media_tokens=count * merged, media_end=head))
    return samples


def vision_flops(counter: FlopCounterMode) -> int:
    """FLOPs ``counter`` counted inside the vision tower (``model.visual``)."""
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith(".visual"))


def cp_rank_main(rank: int, size: int, rendezvous: str, spec: dict, out_dir: str) -> None:
    """One rank of a CP group of ``size`` (1: unsplit, the same code path): a packed row with images, its bytes
    saved for backward and the vision tower's FLOPs counted on the first step, then the step timed."""
    torch.set_num_threads(spec["threads"] or torch.get_num_threads())
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        recipe, backend = load_recipe(RECIPE), spec["backend"]
        model = recipe.build_model(spec["model_cfg"], backend).train()
        samples = image_samples(spec["segments"], model.config, spec["seed"])
        batch = MLLMCollator(model.config.text_config.pad_token_id, pad_to_multiple_of=size)(
            [MLLMPack(samples).to_model_inputs()])
        shard = SequenceShard(dist.group.WORLD, rank, size) if size > 1 else None
        if shard is not None:
            enable_ulysses(model, shard)
        kinds, dummy = media_kinds(model), recipe.dummy_media(model)
        targets = supervised_targets(batch)

        def forward_loss():
            kwargs = recipe.prepare_packed(batch, model, backend)
            if shard is None:
                outputs, zero, span = model(**kwargs), None, None
            else:
                outputs, zero = sequence_parallel_forward(model, kwargs, shard, kinds, dummy, 0)
                span = shard.span(batch["input_ids"].shape[-1])
            part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], "token", span)
            loss = part.weighted_sum / targets
            return loss if zero is None else loss + zero

        with FlopCounterMode(display=False) as counter, SavedForBackward(model) as saved:
            loss = forward_loss()
        loss.backward()
        model.zero_grad(set_to_none=True)
        times = []
        for _ in range(1 + spec["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            forward_loss().backward()
            dist.barrier()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        result = {"saved_bytes": saved.bytes, "vision_flops": vision_flops(counter), "step_s": min(times[1:]),
                  "tokens": int(batch["input_ids"].numel()), "local_tokens": int(batch["input_ids"].numel()) // size}
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def measure_split(spec: dict, size: int, workdir: Path) -> list[dict]:
    """Per rank, the numbers of one row on a CP group of ``size`` spawned here."""
    out_dir = Path(tempfile.mkdtemp(dir=workdir, prefix=f"cp{size}-"))
    torch.multiprocessing.spawn(cp_rank_main, nprocs=size, join=True,
                                args=(size, str(out_dir / "rendezvous"), spec, str(out_dir)))
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(size)]


def cp_rows(args: argparse.Namespace, model_cfg: dict, backends: list[str],
            segments: dict[int, list[int]]) -> list[dict]:
    """CP = 1 and CP = N per (backend, L): the worst rank's saved bytes, vision FLOPs and step time."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_long_cp-") as tmp:
        for length in args.lengths:
            for backend in backends:
                spec = {"model_cfg": model_cfg, "segments": segments[length], "threads": args.threads,
                        "repeats": args.repeats, "seed": args.seed, "backend": backend}
                for size in (1, args.context_parallel):
                    progress(f"measuring {backend} at L={length}, CP={size} ...")
                    ranks = measure_split(spec, size, Path(tmp))
                    rows.append({"backend": backend, "length": length, "cp": size, "ranks": ranks,
                                 **{key: max(r[key] for r in ranks) for key in ("saved_bytes", "vision_flops",
                                                                                "step_s")}})
    return rows


def cp_ratio(rows: list[dict], backend: str, length: int, key: str, size: int) -> float | None:
    one = next((r for r in rows if (r["backend"], r["length"], r["cp"]) == (backend, length, 1)), None)
    split = next((r for r in rows if (r["backend"], r["length"], r["cp"]) == (backend, length, size)), None)
    return None if not one or not split or not one[key] else split[key] / one[key]


def cp_targets(rows: list[dict], backend: str, lengths: list[int], size: int) -> list[dict]:
    """At L = 8192 (else the longest L): per-rank saved bytes and vision FLOPs, CP = N over CP = 1 (images are
    encoded whole, so a short row with few images cannot split its vision work evenly: the other lengths are
    printed, not judged); with several lengths, CP = N's saved bytes growing linearly."""
    at = CP_TARGET_LENGTH if CP_TARGET_LENGTH in lengths else max(lengths)
    out = []
    for name, key, limit, what in (("cp_saved", "saved_bytes", CP_TARGET_SAVED, "bytes saved for backward"),
                                   ("cp_vision", "vision_flops", CP_TARGET_VISION, "vision-tower FLOPs")):
        value = cp_ratio(rows, backend, at, key, size)
        others = [f"L={n} {'-' if (v := cp_ratio(rows, backend, n, key, size)) is None else f'{v:.3f}'}"
                  for n in lengths if n != at]
        out.append({"name": name, "value": value, "limit": limit, "ok": value is not None and value <= limit,
                    "line": f"({len(out) + 1}) per-rank {what} at L={at}, CP={size} / CP=1 <= {limit}: "
                            f"{'not measured' if value is None else f'{value:.3f}'}"
                            + (f" (also {', '.join(others)})" if others else "")})
    if len(lengths) > 1:
        low, high = min(lengths), max(lengths)
        split = {r["length"]: r["saved_bytes"] for r in rows if r["backend"] == backend and r["cp"] == size}
        growth = split[high] / split[low] if split.get(low) else None
        bound = TARGET_GROWTH_SLACK * high / low
        out.append({"name": "cp_growth", "value": growth, "limit": bound, "ok": growth is not None and growth <= bound,
                    "line": f"(3) CP={size} saved bytes grow linearly: L={high} / L={low} <= {TARGET_GROWTH_SLACK} x "
                            f"{high}/{low} = {bound:.2f}: {'-' if growth is None else f'{growth:.3f}'}"})
    for target in out:
        target["line"] += f" -> {verdict(target['ok'])}"
    return out


def main_context_parallel(args: argparse.Namespace, model_cfg: dict, backends: list[str], skipped: dict[str, str],
                          segments: dict[int, list[int]], started: float) -> dict:
    """``--context-parallel N``: CP = 1 vs CP = N on one packed row with images per (backend, L)."""
    rows = cp_rows(args, model_cfg, backends, segments)
    lines = header_lines(args, model_cfg, backends, skipped, segments)
    lines[1] += (f"; each segment opens with one image of {math.prod(IMAGE_GRID)} patches per {TOKENS_PER_IMAGE} "
                 "tokens; CP ranks over gloo, numbers of the worst rank; saved = bytes autograd keeps for backward "
                 "(SavedForBackward), vision = FlopCounterMode inside model.visual on the first step")
    lines.append(f"{'backend':<14s} {'L':>6s} {'CP':>3s} {'saved MiB/rank':>15s} {'vision GFLOP/rank':>18s} "
                 f"{'step s':>8s}")
    for row in rows:
        lines.append(f"{row['backend']:<14s} {row['length']:>6d} {row['cp']:>3d} {row['saved_bytes'] / MIB:>15.1f} "
                     f"{row['vision_flops'] / 1e9:>18.3f} {row['step_s']:>8.3f}")
    targets = cp_targets(rows, args.default_backend, args.lengths, args.context_parallel)
    lines.append(f"targets for {args.default_backend}:")
    lines += [f"  {t['line']}" for t in targets]
    seconds = time.perf_counter() - started
    lines.append(f"bench time {seconds:.1f} s")
    return {"recipe": RECIPE, "args": vars(args), "backends": backends, "skipped": skipped, "rows": rows,
            "targets": targets, "ok": all(t["ok"] for t in targets), "seconds": seconds, "lines": lines}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="packed row lengths")
    parser.add_argument("--recipe", choices=RECIPES, default=RECIPE, help="whose language model and packed inputs")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="attention backends to try (default: every one the recipe offers); those this machine "
                             "cannot train with are skipped (see --forward-only)")
    parser.add_argument("--forward-only", action="store_true",
                        help="run a backend this machine can only run forward (flex on CPU) forward only")
    parser.add_argument("--sliding-window", type=int, default=DEFAULT_SLIDING_WINDOW,
                        help="Gemma recipes: the sliding layers' window")
    parser.add_argument("--default-backend", default="sdpa_varlen", help="the backend the targets are checked for")
    parser.add_argument("--hidden", type=int, default=256, help="text_config.hidden_size")
    parser.add_argument("--intermediate", type=int, default=512, help="text_config.intermediate_size")
    parser.add_argument("--layers", type=int, default=2, help="text_config.num_hidden_layers")
    parser.add_argument("--heads", type=int, default=4, help="text_config.num_attention_heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="text_config.num_key_value_heads")
    parser.add_argument("--segment-median", type=float, default=700.0, help="median segment length (tokens)")
    parser.add_argument("--segment-sigma", type=float, default=0.5, help="sigma of the log-normal segment lengths")
    parser.add_argument("--max-segment", type=int, default=4096, help="longest segment drawn (also capped to L)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0,
                        help="kill a measurement whose process RSS passes this (GiB)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="kill a measurement (warm-up and repeats) running longer than this (0: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="segment lengths, token ids and weights")
    parser.add_argument("--context-parallel", type=int, default=1,
                        help="N > 1: CP = 1 vs CP = N (N gloo ranks started here) on one packed row with images")
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args(argv)
    if args.backends is None:
        args.backends = list(load_recipe(args.recipe).attention_backends)
    if args.context_parallel > 1 and args.recipe != RECIPE:
        parser.error(f"--context-parallel runs on --recipe {RECIPE}")
    if args.sliding_window < 1:
        parser.error("--sliding-window must be >= 1")
    if args.context_parallel < 1 or args.heads % args.context_parallel or args.kv_heads % args.context_parallel:
        parser.error("--context-parallel must be >= 1 and divide --heads and --kv-heads")
    if min(args.lengths) < 2 * MIN_SEGMENT:
        parser.error(f"--lengths must be >= {2 * MIN_SEGMENT}")
    args.lengths = sorted(set(args.lengths))
    for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads or (args.hidden // args.heads) % 8 or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of 8 x --heads, and --heads a multiple of --kv-heads")
    if args.max_segment < MIN_SEGMENT or args.segment_median <= 0 or args.segment_sigma < 0:
        parser.error(f"--max-segment must be >= {MIN_SEGMENT}, --segment-median > 0, --segment-sigma >= 0")
    if args.threads < 0 or args.memory_limit_gib <= 0 or args.timeout_s < 0:
        parser.error("--threads and --timeout-s must be >= 0, --memory-limit-gib > 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    backends, skipped = runnable_backends(args.backends, args.recipe, args.forward_only)
    model_cfg = model_config(args)
    segments = {length: segment_lengths(length, args.segment_median, args.segment_sigma, args.max_segment, args.seed)
                for length in args.lengths}
    if args.context_parallel > 1:
        result = main_context_parallel(args, model_cfg, backends, skipped, segments, started)
    else:
        rows, references = measure_all(args, model_cfg, backends, segments)
        result = report(args, model_cfg, backends, skipped, segments, rows, references, time.perf_counter() - started)
    print("\n".join(result["lines"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
elif __name__ == WORKER_RUN_NAME:  # a measuring process started by ``measure`` (see there)
    worker(*globals()["WORKER_ARGS"])
