"""Data at scale: how long a start takes and how much memory it keeps, from 100 k to 1 M records, against targets.

Why: a run must start in seconds on millions of records and keep memory flat in the data set size (issue 10). This
measures exactly what a training start does with the DataKit: the engine's ``build_run_dataset`` (what the trainer
calls: ``MLLMDataKit.build_dataset``) with the ``qwen2_vl`` recipe's real encoder (``build_processor`` on
``conf/model/qwen2_vl_tiny.yaml``, the run specs composed as ``python -m recipes.qwen2_vl.train +packing=greedy
data.max_seq_len=4096`` composes them), then forces measuring and planning
(``dataset.estimate_total_steps(epochs=1, micro_batch_size=1)`` and ``len(dataset)``).

Data: seeded synthetic LLaVA-format JSONL sets written into ``--workdir`` (default: a temporary folder, removed at
the end) and reused across phases and, with a given ``--workdir``, across runs. Every record is
``{"id", "image"?, "conversations"}``; English words, lengths in words log-normal: 82 % image QA (question median
12, answer median 60), 15 % text-only (25 / 120), 2 % multi-turn image chats (2-5 exchanges), 1 % long image
descriptions (median 900 words). Image records name one of ``IMAGES`` real image files (JPEG and PNG, 64..2048
pixels a side), shared by many records; the encoder reads their headers. A smaller set is the prefix of a larger
one (records are drawn in seeded chunks).

Phases, each in a fresh ``python`` process started here (RSS numbers are that phase's own), each cold start with a
fresh ``data.cache_dir``, its warm start on the same one:

1. at ``--parallel-size`` (200 k) records: a cold start with ``data.measure_workers=1``, one with 2 workers, then a
   warm start (measure cache hit) on the 2-worker cache;
2. at each of ``--sizes`` (100 k and 1 M): a cold start (2 workers) to fill the cache, then a warm start;
3. at each of ``--sizes``: the per-item cost of the dataset without the encoder: handing out the next pack's record
   indices and reading its records from the store (``rank_packs()`` iterated, ``dataset.records[i]``), for the
   greedy spec (a replayed plan) and for bfd over the whole set (a stored plan, ``rank_packs()[j]`` per item as
   ``__getitem__`` does); best of ``--repeats`` runs of ``--items`` packs, the epoch's start excluded (reported).
   This phase also iterates the greedy ``rank_packs()`` to its end and checks the count against the step estimate.

Per phase: wall time of the start split into store open (``build_dataset``: JSONL converted to Arrow on a cold
start), measure (``dataset.metas``: measured or read from the cache) and plan; the start's CPU time (measuring
workers included) and the load average at its end, which tell other work on the two cores (a wall time twice the
CPU time over two workers) from a slow start; whether the measure cache was hit
(no file of the cache folder written, lock files aside); peak RSS (``ru_maxrss``, the whole process since it
started; the measuring workers' own peak separately); RssAnon (``/proc/self/status``: memory-mapped files excluded)
once the dataset is built, relative to a baseline taken after the imports and the encoder build (fixed costs).

Targets (issue 10, this 2-core machine), each printed with its measured value and OK/MISS:

1. at 200 k records, warm start >= 20x faster than the faster cold start (the honest comparison);
2. cold measuring (the measure part) with 2 processes >= 1.5x faster than with 1;
3. at the largest size (1 M), warm start < 60 s;
4. at the largest size, peak RSS of the warm start < 2 GiB;
5. RssAnon of the warm start growing by < 300 bytes per record from the smallest to the largest size;
6. per-item dataset overhead flat: at the largest size <= 1.5x the smallest, for greedy and bfd. The path is O(1)
   per item by design, so anything growing with the set (10x from 100 k to 1 M if linear) must fail, while a
   logarithmic term (``searchsorted`` over sources) and cache effects of a 10x larger mapped file, plus timing
   noise on a shared machine, fit in 1.5x.

Then three checks (every start after a cold one hit the cache; the step estimate equals the packs iterated; every
phase of a set planned the same packs) and the extrapolation to 10 M records, linear through the two sizes, of cold
measuring, the cold and warm start, RssAnon and peak RSS.

    python tools/bench_data.py [--sizes 100000 1000000] [--parallel-size 200000] [--workdir DIR] [--skip-1m]
        [--items 2000] [--repeats 3] [--max-seq-len 4096] [--seed 0] [--json PATH]

With no arguments the whole run takes about an hour on this machine (68 minutes measured, with other tests sharing
its two cores), most of it measuring 1.5 M records cold: the recipe's encoder costs about 3 ms of CPU a record on
this mix (the chat template rendered per assistant turn, the text tokenized with offsets), so the 1 M cold start
alone takes 25-45 minutes on two processes. ``--skip-1m`` uses the parallel size (200 k, already measured)
as the largest size instead. Progress goes to stderr, the report to stdout, each phase's own output to
``<workdir>/logs``. ``main(argv)`` returns what it printed as a dict.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from PIL import Image

TOOL = Path(__file__).resolve()  # each phase runs it again, in a fresh process
RECIPE = "qwen2_vl"
DEFAULT_SIZES = (100_000, 1_000_000)
DEFAULT_PARALLEL_SIZE = 200_000
EXTRAPOLATE_TO = 10_000_000

TARGET_WARM_SPEEDUP = 20.0
TARGET_PARALLEL_SPEEDUP = 1.5
TARGET_WARM_START_S = 60.0
TARGET_PEAK_GIB = 2.0
TARGET_ANON_BYTES_PER_RECORD = 300.0
TARGET_ITEM_RATIO = 1.5

DATA_FORMAT = 1  # bump when the synthetic records change: a reused --workdir then writes its sets again
CHUNK = 100_000  # records drawn per seeded chunk: a smaller set is the prefix of a larger one
IMAGES = 36
GIB, MIB = 2**30, 2**20

WORDS = np.array((
    "the a an of to in on at for with from by about over under into near behind between this that these those it "
    "its is are was were be been has have had do does can could will would should may might must there here what "
    "which who where when why how many much some any each every all both few more most other another such only "
    "very also just not no yes image picture photo scene man woman child people dog cat bird horse car bus train "
    "street road building house room table chair window door wall floor sky cloud tree grass water river sea beach "
    "mountain field park city sign light shirt hat bag phone book plate food cup bottle left right top bottom front "
    "back side center middle large small big little tall short long red blue green yellow white black brown gray "
    "orange pink bright dark old young new open closed sitting standing walking holding looking wearing playing "
    "eating riding driving showing appears seems looks shows contains features depicts describe explain answer "
    "question detail color shape number count group several two three four five first second because while during "
    "after before then so but and or if as like than"
).split())

WORD_LENGTHS = np.char.str_len(WORDS)
KINDS = ("image QA", "text only", "multi-turn image chat", "long image description")
KIND_SHARES = (0.82, 0.15, 0.02, 0.01)
# (median words, sigma, min, max) of a question and of an answer, per kind
QUESTION_WORDS = ((12, 0.5, 3, 60), (25, 0.8, 3, 300), (12, 0.5, 3, 60), (10, 0.4, 3, 40))
ANSWER_WORDS = ((60, 0.9, 1, 800), (120, 1.0, 1, 1500), (50, 0.8, 1, 300), (900, 0.4, 200, 2500))
STREAM_WORDS = 400_000  # one chunk's word stream; every text is a window of it


# ------------------------------------------------------------------------------------------- synthetic data


def write_images(folder: Path, seed: int) -> list[str]:
    """``IMAGES`` real JPEG / PNG files of varied sizes (header-readable, tiny on disk: flat colours); written once,
    kept afterwards (a rewrite would change their modification time, which the measure cache checks)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, DATA_FORMAT, 0])
    names = []
    for k in range(IMAGES):
        width = int(rng.integers(64, 2049))
        height = int(np.clip(width / rng.uniform(0.5, 2.0), 64, 2048))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        name = f"img{k:02d}-{width}x{height}.{'jpg' if k % 2 else 'png'}"
        path = folder / name
        if not path.exists():
            partial = folder / f".partial-{name}"
            Image.new("RGB", (width, height), color).save(partial, format="JPEG" if k % 2 else "PNG")
            os.replace(partial, path)
        names.append(name)
    return names


def lognormal_words(rng: np.random.Generator, shape: tuple[int, ...], params: tuple) -> np.ndarray:
    median, sigma, low, high = params
    return np.clip(rng.lognormal(math.log(median), sigma, shape), low, high).astype(np.int64)


def chunk_records(chunk: int, count: int, images: list[str], seed: int) -> list[str]:
    """JSONL lines of the first ``count`` records of chunk ``chunk`` (the module docstring's mix): every draw is made
    for a whole chunk, so a set's records do not depend on its size."""
    rng = np.random.default_rng([seed, DATA_FORMAT, 1, chunk])
    picks = rng.integers(len(WORDS), size=STREAM_WORDS)
    stream = " ".join(WORDS[picks])
    starts = np.concatenate([[0], np.cumsum(WORD_LENGTHS[picks] + 1)])
    kinds = rng.choice(len(KINDS), size=CHUNK, p=KIND_SHARES)
    turns = np.where(kinds == 2, rng.integers(2, 6, size=CHUNK), 1)
    image = rng.integers(len(images), size=CHUNK)
    questions = {k: lognormal_words(rng, (CHUNK, 5), QUESTION_WORDS[k]) for k in range(len(KINDS))}
    answers = {k: lognormal_words(rng, (CHUNK, 5), ANSWER_WORDS[k]) for k in range(len(KINDS))}
    offsets = rng.integers(0, STREAM_WORDS - 3000, size=(CHUNK, 10))

    def text(words: int, offset: int) -> str:
        return stream[starts[offset]:starts[offset + words] - 1]

    lines = []
    for j in range(count):
        kind = int(kinds[j])
        conversations = []
        for t in range(int(turns[j])):
            question = text(int(questions[kind][j, t]), int(offsets[j, 2 * t])) + "?"
            if t == 0 and kind != 1:
                question = "<image>\n" + question
            answer = text(int(answers[kind][j, t]), int(offsets[j, 2 * t + 1])) + "."
            conversations += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        record = {"id": f"syn-{chunk * CHUNK + j}", "conversations": conversations}
        if kind != 1:
            record["image"] = f"images/{images[image[j]]}"
        lines.append(json.dumps(record))
    return lines


def write_set(folder: Path, size: int, images: list[str], seed: int) -> Path:
    """The JSONL set of ``size`` records, written once per (size, seed, format) and reused."""
    path = folder / f"llava-{size}-seed{seed}-v{DATA_FORMAT}.jsonl"
    if path.exists():
        return path
    partial = folder / f".partial-{path.name}"
    with partial.open("w") as handle:
        for chunk in range(math.ceil(size / CHUNK)):
            lines = chunk_records(chunk, min(CHUNK, size - chunk * CHUNK), images, seed)
            handle.write("\n".join(lines) + "\n")
    os.replace(partial, path)
    return path


# -------------------------------------------------------------------------------- inside a phase process


def memory_kib(field: str) -> int:
    """A field of ``/proc/self/status`` (``RssAnon``, ``VmRSS``) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def anon_bytes() -> int:
    """Anonymous RSS after a collection: the heap and arrays, not the memory-mapped Arrow files."""
    gc.collect()
    return memory_kib("RssAnon") * 1024


def cache_files(cache: Path) -> dict[str, int]:
    """Every file of the cache folder -> its modification time; lock files aside (taking a lock touches them)."""
    if not cache.is_dir():
        return {}
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")}


def compose_run(spec: dict, packing: str):
    """The run specs and the recipe as ``python -m recipes.qwen2_vl.train`` builds them for this phase."""
    from mvp_engine.engine.config import compose_config, resolve_run_specs
    from mvp_engine.engine.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    overrides = [f"+packing={packing}", f"data.max_seq_len={spec['max_seq_len']}",
                 f"data.sources=['{spec['source']}']", f"data.cache_dir='{spec['cache']}'",
                 f"data.measure_workers={spec['workers']}"]
    if packing == "bfd":  # a whole-set plan: the buffer covers the set (conf/packing/bfd.yaml's covers 1 M)
        overrides.append(f"packing.buffer_size={max(spec['size'], 1_000_000)}")
    cfg = compose_config(RECIPE, overrides)
    return resolve_run_specs(cfg, recipe.attention_backends), recipe, cfg.model


def cpu_seconds() -> float:
    """User + system time of this process and of its finished children (the measuring workers)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def start_dataset(build_run_dataset, specs, encoder) -> tuple[object, dict]:
    """A start: build the run's dataset (``build_run_dataset``, as the trainer does), measure, plan; the wall time of
    each part, and the CPU time and load average that tell a slow machine (other work on its cores) from a slow
    start."""
    cpu = cpu_seconds()
    started = time.perf_counter()
    dataset = build_run_dataset(specs, encoder, cost_profile=None)
    opened = time.perf_counter()
    _ = dataset.metas
    measured = time.perf_counter()
    steps = dataset.estimate_total_steps(epochs=1, micro_batch_size=1)
    packs = len(dataset)
    planned = time.perf_counter()
    return dataset, {"store_s": opened - started, "measure_s": measured - opened, "plan_s": planned - measured,
                     "start_s": planned - started, "cpu_s": cpu_seconds() - cpu, "load_avg": os.getloadavg()[0],
                     "steps": steps, "packs": packs,
                     "dataset": type(dataset).__name__, "bad_records": dataset.bad_records.count}


def read_pack(dataset, pack: list[int]) -> None:
    for i in pack:
        dataset.records[i]


def greedy_items(dataset, items: int, repeats: int) -> dict:
    """The streaming dataset's per-item path: the next pack of a ``rank_packs()`` iteration and its records."""
    started = time.perf_counter()
    iterated = sum(1 for _ in dataset.rank_packs())
    replay_s = time.perf_counter() - started
    best, epoch_start_s, served, records = math.inf, math.inf, 0, 0
    for _ in range(repeats):
        started = time.perf_counter()
        packs = iter(dataset.rank_packs())
        read_pack(dataset, next(packs))  # the epoch's start (its record order, the first window): once per epoch
        begun = time.perf_counter()
        served = records = 0
        for pack in islice(packs, items):
            read_pack(dataset, pack)
            served, records = served + 1, records + len(pack)
        if served:
            best = min(best, (time.perf_counter() - begun) / served)
        epoch_start_s = min(epoch_start_s, begun - started)
    return {"iterated_packs": iterated, "replay_s": replay_s, "per_item_s": best if served else None,
            "epoch_start_s": epoch_start_s, "items": served, "repeats": repeats,
            "records_per_item": records / served if served else None}


def bfd_items(dataset, items: int, repeats: int) -> dict:
    """The map-style dataset's per-item path: ``rank_packs()[j]`` (as ``__getitem__`` asks) and its records."""
    count = min(items, len(dataset))
    iterated = sum(1 for _ in dataset.rank_packs())
    best, records = math.inf, 0
    for _ in range(repeats):
        started = time.perf_counter()
        records = 0
        for j in range(count):
            pack = dataset.rank_packs()[j]
            read_pack(dataset, pack)
            records += len(pack)
        best = min(best, (time.perf_counter() - started) / max(count, 1))
    return {"iterated_packs": iterated, "per_item_s": best if count else None, "items": count, "repeats": repeats,
            "records_per_item": records / count if count else None}


def phase_main(spec_path: str) -> None:
    """Entry of a phase process: one start (and the per-item measurements of an ``items`` phase) -> result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    began = time.perf_counter()
    import datasets  # noqa: F401 - the store imports it lazily; an import, not part of opening the store

    from mvp_engine.engine.recipe import load_recipe
    from mvp_engine.engine.run_data import build_run_dataset

    load_recipe(RECIPE)
    imported = time.perf_counter()
    specs, recipe, model_cfg = compose_run(spec, "greedy")
    encoder = recipe.build_encoder(recipe.build_processor(model_cfg))
    baseline_anon = anon_bytes()
    encoder_s = time.perf_counter() - imported
    cache = Path(spec["cache"])
    before = cache_files(cache)
    started_at = time.time()
    dataset, result = start_dataset(build_run_dataset, specs, encoder)
    built_anon = anon_bytes()
    after = cache_files(cache)
    written = sorted(name for name, mtime in after.items() if before.get(name) != mtime)
    result.update(imports_s=imported - began, encoder_s=encoder_s, started_at=started_at,
                  baseline_anon_bytes=baseline_anon, anon_bytes=built_anon,
                  anon_growth_bytes=built_anon - baseline_anon,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  workers_peak_rss_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  cache_written=written, cache_hit=bool(before) and not any(n.startswith("measure") for n in written))
    if spec["kind"] == "items":
        result["greedy"] = greedy_items(dataset, spec["items"], spec["repeats"])
        bfd_specs, _, _ = compose_run(spec, "bfd")
        bfd_dataset, bfd_start = start_dataset(build_run_dataset, bfd_specs, encoder)
        result["bfd"] = {**bfd_start, **bfd_items(bfd_dataset, spec["items"], spec["repeats"])}
    Path(spec["result"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ the parent


@dataclass
class Phase:
    """One fresh process: a ``cold`` or ``warm`` start, or an ``items`` measurement (a warm start first)."""

    kind: str
    size: int
    workers: int
    cache: str  # folder name under <workdir>/caches: a cold start empties it, the others reuse it

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.workers}w-{self.size}" if self.kind == "cold" else f"{self.kind}-{self.size}"


def plan_phases(sizes: list[int], parallel_size: int) -> list[Phase]:
    """Phase 1 at the parallel size, then a cold and a warm start per size (the parallel size's are reused), then
    the per-item measurements."""
    both = f"{parallel_size}-2w"
    phases = [Phase("cold", parallel_size, 1, f"{parallel_size}-1w"), Phase("cold", parallel_size, 2, both),
              Phase("warm", parallel_size, 2, both)]
    for size in sizes:
        if size != parallel_size:
            phases += [Phase("cold", size, 2, f"{size}-2w"), Phase("warm", size, 2, f"{size}-2w")]
    return phases + [Phase("items", size, 2, f"{size}-2w") for size in sizes]


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_phase(phase: Phase, source: Path, workdir: Path, args: argparse.Namespace) -> dict:
    """Run one phase in a fresh ``python`` process; its result, or ``{"error": why}``."""
    cache = workdir / "caches" / phase.cache
    if phase.kind == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    runs = workdir / "phases"
    runs.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    spec = {"kind": phase.kind, "size": phase.size, "workers": phase.workers, "source": str(source),
            "cache": str(cache), "max_seq_len": args.max_seq_len, "items": args.items, "repeats": args.repeats,
            "result": str(runs / f"{phase.name}.result.json")}
    spec_path = runs / f"{phase.name}.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    log_path = workdir / "logs" / f"{phase.name}.log"
    progress(f"{phase.name}: {phase.size:,} records, cache {cache.name} ...")
    started = time.perf_counter()
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    with log_path.open("w") as log:
        code = subprocess.run([sys.executable, str(TOOL), "--phase", str(spec_path)], stdout=log,
                              stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - started
    if code == 0 and Path(spec["result"]).exists():
        result = json.loads(Path(spec["result"]).read_text())
        progress(f"  done in {seconds:.1f} s (start {result['start_s']:.1f} s)")
    else:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        result = {"error": f"exit code {code}: {lines[-1].strip() if lines else 'no output'} (log {log_path})"}
        progress(f"  failed: {result['error']}")
    return {**asdict(phase), "name": phase.name, "cache_dir": str(cache), "log": str(log_path),
            "process_s": seconds, **result}


# --------------------------------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISS"


def find(phases: list[dict], kind: str, size: int, workers: int | None = None) -> dict | None:
    for phase in phases:
        if phase["kind"] == kind and phase["size"] == size and workers in (None, phase["workers"]):
            return phase
    return None


def missing(*phases: dict | None) -> str | None:
    """Why a target has no value: a phase not run or failed; None when all are there."""
    for phase in phases:
        if phase is None:
            return "not measured"
        if "error" in phase:
            return f"{phase['name']} failed: {phase['error']}"
    return None


def target(number: int, name: str, head: str, value: float | None, limit: float, ok: bool, shown: str,
           **extra) -> dict:
    return {"number": number, "name": name, "value": value, "limit": limit, "ok": ok, **extra,
            "line": f"({number}) {head}: {shown} -> {verdict(ok)}"}


def target_warm_speedup(phases: list[dict], size: int) -> dict:
    colds = [find(phases, "cold", size, 1), find(phases, "cold", size, 2)]
    warm = find(phases, "warm", size)
    head = f"warm start >= {TARGET_WARM_SPEEDUP:g}x faster than the faster cold start at {size:,} records"
    why = missing(*colds, warm)
    if why:
        return target(1, "warm_speedup", head, None, TARGET_WARM_SPEEDUP, False, why)
    cold = min(colds, key=lambda p: p["start_s"])
    value = cold["start_s"] / warm["start_s"]
    ok = value >= TARGET_WARM_SPEEDUP
    return target(1, "warm_speedup", head, value, TARGET_WARM_SPEEDUP, ok,
                  f"cold ({cold['workers']} worker{'s' if cold['workers'] > 1 else ''}) {cold['start_s']:.2f} s / "
                  f"warm {warm['start_s']:.2f} s = {value:.1f}x", cold_workers=cold["workers"])


def target_parallel(phases: list[dict], size: int) -> dict:
    one, two = find(phases, "cold", size, 1), find(phases, "cold", size, 2)
    head = f"cold measuring with 2 processes >= {TARGET_PARALLEL_SPEEDUP:g}x faster than with 1 at {size:,} records"
    why = missing(one, two)
    if why:
        return target(2, "parallel_speedup", head, None, TARGET_PARALLEL_SPEEDUP, False, why)
    value = one["measure_s"] / two["measure_s"]
    ok = value >= TARGET_PARALLEL_SPEEDUP
    return target(2, "parallel_speedup", head, value, TARGET_PARALLEL_SPEEDUP, ok,
                  f"measure {one['measure_s']:.2f} s / {two['measure_s']:.2f} s = {value:.2f}x")


def target_warm_start(phases: list[dict], size: int) -> dict:
    warm = find(phases, "warm", size)
    head = f"warm start at {size:,} records < {TARGET_WARM_START_S:g} s"
    why = missing(warm)
    value = None if why else warm["start_s"]
    ok = value is not None and value < TARGET_WARM_START_S
    return target(3, "warm_start", head, value, TARGET_WARM_START_S, ok, why or f"{value:.2f} s")


def target_peak(phases: list[dict], size: int) -> dict:
    warm = find(phases, "warm", size)
    head = f"peak RSS of the warm start at {size:,} records < {TARGET_PEAK_GIB:g} GiB"
    why = missing(warm)
    value = None if why else warm["peak_rss_bytes"] / GIB
    ok = value is not None and value < TARGET_PEAK_GIB
    return target(4, "peak_rss", head, value, TARGET_PEAK_GIB, ok, why or f"{value:.3f} GiB")


def target_anon(phases: list[dict], small: int, large: int) -> dict:
    low, high = find(phases, "warm", small), find(phases, "warm", large)
    head = (f"RssAnon growth of the warm start from {small:,} to {large:,} records < "
            f"{TARGET_ANON_BYTES_PER_RECORD:g} bytes/record")
    why = missing(low, high) or ("needs two sizes" if small == large else None)
    if why:
        return target(5, "anon_per_record", head, None, TARGET_ANON_BYTES_PER_RECORD, False, why)
    value = (high["anon_growth_bytes"] - low["anon_growth_bytes"]) / (large - small)
    ok = value < TARGET_ANON_BYTES_PER_RECORD
    return target(5, "anon_per_record", head, value, TARGET_ANON_BYTES_PER_RECORD, ok,
                  f"({high['anon_growth_bytes'] / MIB:.1f} MiB - {low['anon_growth_bytes'] / MIB:.1f} MiB) / "
                  f"{large - small:,} = {value:.1f} bytes/record")


def target_items(phases: list[dict], small: int, large: int) -> dict:
    low, high = find(phases, "items", small), find(phases, "items", large)
    head = f"per-item dataset overhead flat: at {large:,} records <= {TARGET_ITEM_RATIO:g}x at {small:,}"
    why = missing(low, high) or ("needs two sizes" if small == large else None)
    ratios, parts = {}, []
    for strategy in ("greedy", "bfd"):
        if why:
            break
        a, b = low[strategy]["per_item_s"], high[strategy]["per_item_s"]
        if not a or b is None:
            why = f"{strategy}: no items measured"
            break
        ratios[strategy] = b / a
        parts.append(f"{strategy} {b * 1e3:.3f} ms / {a * 1e3:.3f} ms = {b / a:.2f}x")
    if why:
        return target(6, "item_ratio", head, None, TARGET_ITEM_RATIO, False, why, ratios=ratios)
    value = max(ratios.values())
    ok = value <= TARGET_ITEM_RATIO
    return target(6, "item_ratio", head, value, TARGET_ITEM_RATIO, ok, f"{', '.join(parts)}; worst {value:.2f}x",
                  ratios=ratios)


def check_steps(phases: list[dict]) -> dict:
    """The step estimate (1 epoch, micro-batch 1, one rank) equals the packs iterated, for each plan."""
    parts, ok = [], True
    for phase in phases:
        if phase["kind"] != "items":
            continue
        if "error" in phase:
            parts.append(f"{phase['size']:,}: {phase['name']} failed")
            ok = False
            continue
        for strategy, steps in (("greedy", phase["steps"]), ("bfd", phase["bfd"]["steps"])):
            iterated = phase[strategy]["iterated_packs"]
            ok = ok and steps == iterated
            parts.append(f"{strategy} {phase['size']:,}: {steps:,} {'==' if steps == iterated else '!='} {iterated:,}")
    ok = ok and bool(parts)
    return {"name": "steps_equal_iterated", "ok": ok,
            "line": f"step estimate == packs iterated: {', '.join(parts) or 'not measured'} -> {verdict(ok)}"}


def check_cache_hits(phases: list[dict]) -> dict:
    """Every start after a cold one read the measure cache (a changed encoder or source would measure again)."""
    later = [p for p in phases if p["kind"] != "cold"]
    misses = [p["name"] for p in later if "error" in p or not p["cache_hit"]]
    ok = bool(later) and not misses
    shown = f"missed: {', '.join(misses)}" if misses else f"{len(later)} of {len(later)}"
    return {"name": "cache_hits", "ok": ok, "line": f"warm and per-item starts hit the measure cache: {shown} -> "
                                                     f"{verdict(ok)}"}


def check_same_packs(phases: list[dict]) -> dict:
    """Every phase of a set planned the same number of greedy packs (cold, warm, items; any worker count)."""
    by_size: dict[int, set[int]] = {}
    for phase in phases:
        if "error" not in phase:
            by_size.setdefault(phase["size"], set()).add(phase["packs"])
    ok = bool(by_size) and all(len(packs) == 1 for packs in by_size.values())
    parts = [f"{size:,}: {', '.join(f'{p:,}' for p in sorted(packs))}" for size, packs in sorted(by_size.items())]
    shown = "; ".join(parts) or "not measured"
    return {"name": "same_packs", "ok": ok,
            "line": f"greedy packs planned, every phase of a set: {shown} -> {verdict(ok)}"}


def extrapolate(phases: list[dict], small: int, large: int, to: int = EXTRAPOLATE_TO) -> dict:
    """Cold measuring, cold and warm start, RssAnon and peak RSS at ``to`` records, linear through the two sizes."""
    points = {"cold_measure_s": ("cold", "measure_s"), "cold_start_s": ("cold", "start_s"),
              "warm_start_s": ("warm", "start_s"), "warm_anon_growth_bytes": ("warm", "anon_growth_bytes"),
              "warm_peak_rss_bytes": ("warm", "peak_rss_bytes")}
    out = {}
    for key, (kind, field) in points.items():
        low, high = find(phases, kind, small, 2), find(phases, kind, large, 2)
        if small == large or missing(low, high):
            out[key] = None
            continue
        slope = (high[field] - low[field]) / (large - small)
        out[key] = {"slope_per_record": slope, "value": high[field] + slope * (to - large)}
    return out


def extrapolation_line(extra: dict, small: int, large: int, to: int = EXTRAPOLATE_TO) -> str:
    def shown(key: str, unit: str) -> str:
        entry = extra[key]
        if entry is None:
            return "not measured"
        if unit == "s":
            return (f"{entry['value']:.0f} s ({entry['value'] / 60:.1f} min; "
                    f"{entry['slope_per_record'] * 1e6:.1f} µs/record)")
        return f"{entry['value'] / GIB:.2f} GiB ({entry['slope_per_record']:.1f} bytes/record)"

    return (f"extrapolated to {to:,} records (linear through {small:,} and {large:,}): cold measuring with 2 "
            f"processes {shown('cold_measure_s', 's')}, cold start {shown('cold_start_s', 's')}, warm start "
            f"{shown('warm_start_s', 's')}, RssAnon growth {shown('warm_anon_growth_bytes', 'b')}, warm peak RSS "
            f"{shown('warm_peak_rss_bytes', 'b')}")


PHASE_HEADER = (f"{'phase':<18s} {'records':>10s} {'cache':>5s} {'store s':>8s} {'measure s':>10s} {'plan s':>8s} "
                f"{'start s':>8s} {'CPU s':>8s} {'load':>5s} {'packs':>8s} {'steps':>8s} {'peak RSS MiB':>13s} "
                f"{'RssAnon +MiB':>13s}")


def format_phase(phase: dict) -> str:
    head = f"{phase['name']:<18s} {phase['size']:>10,d}"
    if "error" in phase:
        return f"{head} failed: {phase['error']}"
    cache = "hit" if phase["cache_hit"] else "miss"
    return (f"{head} {cache:>5s} {phase['store_s']:>8.2f} {phase['measure_s']:>10.2f} {phase['plan_s']:>8.2f} "
            f"{phase['start_s']:>8.2f} {phase['cpu_s']:>8.2f} {phase['load_avg']:>5.2f} {phase['packs']:>8,d} "
            f"{phase['steps']:>8,d} "
            f"{phase['peak_rss_bytes'] / MIB:>13.1f} {phase['anon_growth_bytes'] / MIB:>13.1f}")


def format_items(phase: dict) -> list[str]:
    if "error" in phase:
        return []
    greedy, bfd = phase["greedy"], phase["bfd"]

    def per_item(entry: dict) -> str:
        if entry["per_item_s"] is None:
            return "no items"
        return (f"{entry['per_item_s'] * 1e3:.3f} ms/item ({entry['records_per_item']:.1f} records each, best of "
                f"{entry['repeats']} x {entry['items']:,} items)")

    return [f"  {phase['size']:,} records, greedy: {per_item(greedy)}; epoch start {greedy['epoch_start_s']:.3f} s, "
            f"full replay of {greedy['iterated_packs']:,} packs {greedy['replay_s']:.2f} s",
            f"  {phase['size']:,} records, bfd whole set: {per_item(bfd)}; plan {bfd['plan_s']:.2f} s, "
            f"{bfd['packs']:,} packs"]


def header_lines(args: argparse.Namespace, sets: dict[int, dict]) -> list[str]:
    lines = [f"recipe {RECIPE} encoder (conf/model/qwen2_vl_tiny.yaml), +packing=greedy (conf/packing/greedy.yaml), "
             f"data.max_seq_len={args.max_seq_len}; each phase a fresh process; start = store open + measure + plan "
             f"(wall), CPU = its CPU time, measuring workers included; load = 1-minute load average at its end (2 "
             f"cores); peak RSS = ru_maxrss of the phase process; RssAnon + = after the build minus after imports "
             f"and encoder",
             f"workdir {args.workdir}"]
    for size, info in sorted(sets.items()):
        lines.append(f"  set {size:,} records: {info['bytes'] / MIB:.1f} MiB JSONL, written or found in "
                     f"{info['write_s']:.1f} s ({info['path']})")
    return lines


def report(args: argparse.Namespace, sets: dict[int, dict], phases: list[dict], seconds: float) -> dict:
    """The phases, the per-item lines, the targets, the checks and the extrapolation: every number and its lines."""
    small, large = min(args.sizes), max(args.sizes)
    lines = header_lines(args, sets) + [PHASE_HEADER] + [format_phase(p) for p in phases]
    lines.append("per-item dataset overhead (next pack's record indices + reading its records, no encode):")
    lines += [line for p in phases if p["kind"] == "items" for line in format_items(p)]
    targets = [target_warm_speedup(phases, args.parallel_size), target_parallel(phases, args.parallel_size),
               target_warm_start(phases, large), target_peak(phases, large), target_anon(phases, small, large),
               target_items(phases, small, large)]
    checks = [check_cache_hits(phases), check_steps(phases), check_same_packs(phases)]
    extra = extrapolate(phases, small, large)
    lines.append("targets:")
    lines += [f"  {t['line']}" for t in targets]
    lines.append("checks:")
    lines += [f"  {c['line']}" for c in checks]
    lines.append(extrapolation_line(extra, small, large))
    lines.append(f"bench time {seconds:.1f} s")
    return {"recipe": RECIPE, "args": vars(args), "sets": {str(k): v for k, v in sets.items()}, "phases": phases,
            "targets": targets, "checks": checks, "extrapolation": extra,
            "ok": all(t["ok"] for t in targets + checks), "seconds": seconds, "lines": lines}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="set sizes of phases 2 and 3; the smallest and the largest are compared")
    parser.add_argument("--parallel-size", type=int, default=DEFAULT_PARALLEL_SIZE,
                        help="set size of phase 1 (1 vs 2 measuring processes, warm vs cold)")
    parser.add_argument("--skip-1m", action="store_true",
                        help="drop sizes above the parallel size and use the parallel size as the largest")
    parser.add_argument("--workdir", type=Path, help="sets, caches and logs (default: a temporary folder, removed)")
    parser.add_argument("--items", type=int, default=2000, help="packs per per-item measurement")
    parser.add_argument("--repeats", type=int, default=3, help="per-item measurements; the fastest counts")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="data.max_seq_len (packing follows it)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic records and images")
    parser.add_argument("--json", type=Path, help="write every number and verdict here")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase from its spec file
    args = parser.parse_args(argv)
    if args.skip_1m:
        args.sizes = [size for size in args.sizes if size < args.parallel_size] + [args.parallel_size]
    args.sizes = sorted(set(args.sizes))
    if min(args.sizes) < 1 or args.parallel_size < 1 or args.items < 1 or args.repeats < 1:
        parser.error("--sizes, --parallel-size, --items and --repeats must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    data = args.workdir / "data"
    progress(f"writing the synthetic sets into {data} (kept for reuse) ...")
    images = write_images(data / "images", args.seed)
    sets = {}
    for size in sorted({*args.sizes, args.parallel_size}):
        begun = time.perf_counter()
        path = write_set(data, size, images, args.seed)
        sets[size] = {"path": str(path), "bytes": path.stat().st_size, "write_s": time.perf_counter() - begun}
    phases = [run_phase(phase, Path(sets[phase.size]["path"]), args.workdir, args)
              for phase in plan_phases(args.sizes, args.parallel_size)]
    return report(args, sets, phases, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.phase:
        phase_main(args.phase)
        return None
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
            args.workdir = Path(tmp)
            result = run(args)
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args)
    print("\n".join(result["lines"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
