"""Sharded data at scale: the measure pass of WebDataset tar shards on 1 and 2 ranks, the warm start, a projection.

Why: web-scale corpora are hundreds to thousands of shards, and a start must measure each shard once, shared over
the ranks, then start warm from the cache alone (issue 31). This measures exactly what a training start does with
the DataKit: the engine's ``build_run_dataset`` (``MLLMDataKit.build_dataset``) with the ``qwen2_vl`` recipe's real
encoder (``build_processor`` on ``conf/model/qwen2_vl_tiny.yaml``), then ``dataset.metas`` (the measure pass) and
``dataset.estimate_total_steps`` (the plan).

Data: ``--records`` seeded LLaVA-style records (85 % one image and a question, 15 % text only; question and answer
lengths in words log-normal, medians 12 and 60, as ``tools/bench_data.py``'s image QA) written as ``--shards``
WebDataset tar shards: per record a ``.json`` member (no image path: its image is found by the member's extension
and placed by its ``<image>`` tag) and, for an image record, the image as a ``.jpg`` / ``.png`` / ``.webp`` member
(``IMAGES`` small generated images, 64 to 448 pixels a side, flat colours). The first ``--distinct`` shards are
written record by record, every further shard is a hard link to one of them in turn: its own path, so its own
identity, index and cache entry, as a copy would be, written in no time. Written once per (records, shards, seed,
distinct) into ``--workdir`` and reused.

Phases, each in fresh ``python`` processes started here (RSS numbers are each process's own), every rank with
``data.measure_workers=1`` (one process per rank: the ranks are the parallelism measured):

1. ``cold-1``: one rank (``WORLD_SIZE=1``) on an empty cache: the shards indexed, every record measured;
2. ``cold-2``: two ranks at once (``RANK=0,1``, ``WORLD_SIZE=2``) on another empty cache: each measures the shards
   it claims (``share.py``);
3. ``fill`` (only with ``--cold-shards``): the cold phases measured the first ``--cold-shards`` shards only; this
   opens the whole set on the ``cold-2`` cache (indexing every other shard) and gives each shard past the sample a
   copy of the measure entry of the sample shard it is a link of (the same bytes: the table a measure would write,
   under the shard's own key, ``measure.entry_folders``), so the warm start reads a cache of the whole set;
4. ``warm``: one rank on the whole set and the ``cold-2`` cache: nothing may be measured.

The start's CPU time (user + system, this process and its finished children) tells the ranks' share of the work from
the wall time, which other work on the cores stretches. Every process counts the records its encoder measured
(``measure_batch`` / ``measure`` calls) and which shards they came from; the report checks that on each cold start
every record was measured exactly once, every shard by one rank alone, none on the warm start, and that the whole
set's tokens are the sample's times the shards over the sample; each cache entry's ``done.json`` names the rank that
wrote it. Targets (OK / MISS): the warm start (the DataKit's start, imports aside) under ``--target-warm-s`` and its
peak RSS under ``--target-rss-gib``. Then the projection to ``--project-records`` records on ``--project-ranks``
ranks, from the measured per-record cost of the 1-rank cold measure (wall and CPU) and the 2-rank efficiency, and of
the warm start from its per-shard cost.

    python tools/bench_shards.py [--records 10000] [--shards 20] [--distinct 8] [--cold-shards N] [--workdir DIR]
        [--json PATH] [--project-records 100000000] [--project-ranks 64] [--project-shard-records 5000]

The issue's scale is ``--records 2000000 --shards 400 --cold-shards 8``: measuring all of it cold takes ~0.9 ms of
CPU a record, about 16 minutes on this machine's two cores, so the cold rates come from a sample of shards and the
warm start from the whole set. The warm start is run twice in its process: the repeat, without imports, gives the
cost per shard the projection multiplies. Progress goes to stderr, the report to stdout, each process's output to
``<workdir>/logs``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

TOOL = Path(__file__).resolve()
RECIPE = "qwen2_vl"
SHARDS_FORMAT = 3  # bump when the shards written change: a reused --workdir then writes them again
PROJECT_RECORDS = 100_000_000
PROJECT_RANKS = 64
PROJECT_SHARD_RECORDS = 5_000  # the shards: 2 M records in 400
IMAGES = 24
DISTINCT = 8  # shards written record by record; the others are hard links to them in turn
IMAGE_SHARE = 0.85
WORDS = ("the a of to in on with what is are there color image picture person man woman dog cat car street table "
         "left right top bottom large small red blue green white black two three sitting standing holding near "
         "behind front shows contains appears describe").split()


# ------------------------------------------------------------------------------------------- synthetic shards


def shard_pattern(folder: Path, shards: int, count: int | None = None) -> str:
    """The brace pattern of the first ``count`` (all) of ``shards`` shards written into ``folder``."""
    width = len(str(shards - 1))
    return str(folder / f"shard-{{{0:0{width}d}..{(count or shards) - 1:0{width}d}}}.tar")


def write_shards(folder: Path, records: int, shards: int, seed: int, distinct: int = DISTINCT) -> str:
    """``records`` records of ``bench_data``'s mix in ``shards`` tar shards (written once, reused); their brace
    pattern. Past the first ``distinct`` shards, shard ``s`` is a hard link to shard ``s % distinct`` (its own
    path, so its own identity, index and cache entry, as a copy would be): writing 2 M records one by one would
    take ~10 min here, linking takes a second. Linked shards need ``records`` a multiple of ``shards``."""
    target = folder / f"shards-{records}-{shards}-seed{seed}-d{distinct}-v{SHARDS_FORMAT}"
    width = len(str(shards - 1))
    pattern = shard_pattern(target, shards)
    if (target / "done").is_file():
        return pattern
    if shards > distinct and records % shards:
        raise SystemExit(f"--records {records} is no multiple of --shards {shards} (shards past --distinct "
                         f"{distinct} are links to the first ones, so every shard holds as many records)")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    rng = np.random.default_rng([seed, SHARDS_FORMAT])
    images = _images(rng)
    per_shard = -(-records // shards)
    for s in range(shards):
        if s >= distinct:
            os.link(target / f"shard-{s % distinct:0{width}d}.tar", target / f"shard-{s:0{width}d}.tar")
            continue
        with tarfile.open(target / f"shard-{s:0{width}d}.tar", "w") as tar:
            for k in range(min(per_shard, records - s * per_shard)):
                key = f"{s * per_shard + k:09d}"
                with_image = rng.random() < IMAGE_SHARE
                question, answer = (" ".join(rng.choice(WORDS, size=n)) for n in
                                    np.clip(rng.lognormal(np.log([12, 60]), [0.5, 0.9]), 1, 800).astype(int))
                record = {"id": f"syn-{s * per_shard + k}", "conversations": [
                    {"from": "human", "value": ("<image>\n" if with_image else "") + question + "?"},
                    {"from": "gpt", "value": answer + "."}]}
                if with_image:
                    extension, data = images[int(rng.integers(len(images)))]
                    _add(tar, f"{key}.{extension}", data)
                _add(tar, f"{key}.json", json.dumps(record).encode())
    (target / "done").write_text("")
    return pattern


def _images(rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """``IMAGES`` small encoded images of varied sizes (64 to 448 pixels a side), flat colours: (extension,
    bytes)."""
    images = []
    for k in range(IMAGES):
        width = int(rng.integers(64, 449))
        height = int(np.clip(width / rng.uniform(0.5, 2.0), 64, 448))
        extension, kind = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))[k % 3]
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 256, 3))).save(buffer, format=kind)
        images.append((extension, buffer.getvalue()))
    return images


def _cpu_seconds() -> float:
    """User + system time of this process and its finished children."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def anon_bytes() -> int:
    """``RssAnon`` of this process (``/proc/self/status``): the heap and arrays, not the memory-mapped Arrow files."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


# -------------------------------------------------------------------------------- inside a phase process


def phase_main(spec_path: str) -> None:
    """One rank's start: build the run's dataset, measure (counted), plan -> result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from mvp_engine.engine.config import compose_config, resolve_run_specs
    from mvp_engine.engine.recipe import load_recipe
    from mvp_engine.engine.run import build_run_dataset

    recipe = load_recipe(RECIPE)
    cfg = compose_config(RECIPE, ["+packing=greedy", f"data.max_seq_len={spec['max_seq_len']}",
                                  f"data.sources=['{spec['source']}']", f"data.cache_dir='{spec['cache']}'",
                                  "data.measure_workers=1"])
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    measured: list[str] = []
    # the measure pass calls the encoder's measure_batch where it has one (chat.py), else measure
    name = "measure_batch" if hasattr(encoder, "measure_batch") else "measure"
    measure = getattr(encoder, name)

    def counted(records):
        measured.extend(record.origin for record in (records if name == "measure_batch" else [records]))
        return measure(records)

    setattr(encoder, name, counted)
    if spec.get("fill"):
        started = time.perf_counter()
        dataset = build_run_dataset(specs, encoder, cost_profile=None, rank=rank, world_size=world_size)
        fill_main(spec, dataset, encoder, time.perf_counter() - started)
        return
    cpu = _cpu_seconds()
    started = time.perf_counter()
    dataset = build_run_dataset(specs, encoder, cost_profile=None, rank=rank, world_size=world_size)
    opened = time.perf_counter()
    tokens = int(dataset.metas.length.sum())
    done = time.perf_counter()
    cpu = _cpu_seconds() - cpu
    packs = len(dataset.plan(0).packs)
    planned = time.perf_counter()
    again_s = None
    if spec["again"]:  # the same start once more in this process: the warm start's cost without imports
        again = time.perf_counter()
        _ = build_run_dataset(specs, encoder, cost_profile=None, rank=rank, world_size=world_size).metas
        again_s = time.perf_counter() - again
    shards = sorted({origin.split("#")[0] for origin in measured})
    Path(spec["result"]).write_text(json.dumps({
        "rank": rank, "world_size": world_size, "started_at": time.time() - (planned - started),
        "open_s": opened - started, "measure_s": done - opened, "plan_s": planned - done,
        "start_s": planned - started, "cpu_s": cpu, "records": len(dataset.records), "measured": len(measured),
        "measured_distinct": len(set(measured)), "shards_measured": shards,
        "per_shard_counts": {s: sum(o.startswith(s + "#") for o in measured) for s in shards},
        "packs": packs, "tokens": tokens, "again_s": again_s, "bad_records": dataset.bad_records.count,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "anon_bytes": anon_bytes()}))


def fill_main(spec: dict, dataset, encoder, open_s: float) -> None:
    """The cache of the whole shard set from the cold sample's: every shard indexed (the store is open: timed by
    the caller), then each shard past the sample given the measure entry of the sample shard it is a link of (the
    same bytes, so the same measured table a measure would write, under its own key)."""
    from mvp_engine.kit.mllm.data.measure import encoder_fingerprint, entry_folders

    started = time.perf_counter()
    folders = entry_folders(dataset.records, encoder_fingerprint(encoder), spec["cache"])
    copied = 0
    for number, folder in enumerate(folders):
        twin = folders[number % spec["fill"]["distinct"]]
        if number >= spec["fill"]["sample"] and not folder.exists():
            shutil.copytree(twin, folder)
            copied += 1
    Path(spec["result"]).write_text(json.dumps({"copied": copied, "entries": len(folders), "open_s": open_s,
                                                "copy_s": time.perf_counter() - started}))


# ------------------------------------------------------------------------------------------------ the parent


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_ranks(name: str, ranks: int, source: str, cache: Path, workdir: Path, args: argparse.Namespace,
              fill: dict | None = None) -> list[dict]:
    """``ranks`` phase processes at once (``RANK``, ``WORLD_SIZE`` set); each one's result, or ``{"error": ...}``."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "phases").mkdir(exist_ok=True)
    children = []
    started = time.perf_counter()
    for rank in range(ranks):
        spec = {"source": source, "cache": str(cache), "max_seq_len": args.max_seq_len, "again": name == "warm",
                "fill": fill,
                "result": str(workdir / "phases" / f"{name}-{rank}.result.json")}
        spec_path = workdir / "phases" / f"{name}-{rank}.json"
        spec_path.write_text(json.dumps(spec))
        Path(spec["result"]).unlink(missing_ok=True)
        log = (workdir / "logs" / f"{name}-{rank}.log").open("w")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        children.append((subprocess.Popen([sys.executable, str(TOOL), "--phase", str(spec_path)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env), spec, log))
    results = []
    for process, spec, log in children:
        code = process.wait()
        log.close()
        if code == 0 and Path(spec["result"]).exists():
            results.append({**json.loads(Path(spec["result"]).read_text()), "process_s": time.perf_counter() - started})
        else:
            results.append({"error": f"exit code {code} (log {log.name})"})
    progress(f"{name}: done in {time.perf_counter() - started:.1f} s")
    return results


def entries_by_rank(cache: Path) -> dict[str, int]:
    """Measure cache entries per rank that wrote them (``done.json``'s ``measured_by``)."""
    counts: dict[str, int] = {}
    for done in (cache / "measure").glob("*/done.json"):
        rank = str(json.loads(done.read_text()).get("measured_by", {}).get("rank"))
        counts[rank] = counts.get(rank, 0) + 1
    return counts


def check_once(results: list[dict], records: int, shards: int) -> dict:
    """Every record measured exactly once over the ranks, every shard whole by one rank."""
    measured = sum(r["measured"] for r in results)
    distinct = sum(r["measured_distinct"] for r in results)
    owners = [s for r in results for s in r["shards_measured"]]
    ok = measured == distinct == records and len(owners) == len(set(owners)) == shards
    return {"ok": ok, "measured": measured, "records": records, "shards_measured": len(owners),
            "shards": shards, "shards_per_rank": [len(r["shards_measured"]) for r in results]}


def report(args: argparse.Namespace, cold1: list[dict], cold2: list[dict], fill: list[dict] | None,
           warm: list[dict], entries: dict, write_s: float) -> dict:
    failed = [r["error"] for r in (*cold1, *cold2, *(fill or []), *warm) if "error" in r]
    if failed:
        return {"error": failed}
    one, [w] = cold1[0], warm
    records, shards = args.records, args.shards
    sample_records, sample_shards = one["records"], args.cold_shards or shards
    two_wall = max(r["started_at"] + r["start_s"] for r in cold2) - min(r["started_at"] for r in cold2)
    two_measure = max(r["measure_s"] for r in cold2)
    per_record = one["measure_s"] / sample_records
    efficiency = one["measure_s"] / two_measure / 2
    project_shards = args.project_records / args.project_shard_records
    per_shard_warm = w["again_s"] / shards  # a warm start's cost per shard, imports and fixed costs aside
    projection = {
        "per_record_ms": 1e3 * per_record, "per_shard_s": per_record * sample_records / sample_shards,
        "two_rank_efficiency": efficiency,
        "cold_measure_h_ideal": args.project_records * per_record / args.project_ranks / 3600,
        "cold_measure_h_at_measured_efficiency": args.project_records * per_record / args.project_ranks
        / min(1.0, efficiency) / 3600,
        # a rank with a core of its own: the CPU time a record cost, whatever else ran on the cores
        "cold_measure_h_at_cpu_cost": args.project_records * one["cpu_s"] / sample_records / args.project_ranks
        / 3600,
        # the repeat opens and reads every shard's cache (per shard); the plan grows with the records; the rest is fixed
        "warm_start_s": w["start_s"] - w["again_s"] - w["plan_s"] + per_shard_warm * project_shards
        + w["plan_s"] / w["records"] * args.project_records, "shards": project_shards,
        "warm_per_shard_ms": 1e3 * per_shard_warm, "warm_plan_s": w["plan_s"] / w["records"] * args.project_records}
    rows = [("cold, 1 rank", one["start_s"], one["open_s"], one["measure_s"], one["cpu_s"],
             sample_records / one["measure_s"], one["peak_rss_bytes"],
             f"{len(one['shards_measured'])} shards, {one['measured']:,} records"),
            *[(f"cold, 2 ranks: rank {r['rank']}", r["start_s"], r["open_s"], r["measure_s"], r["cpu_s"],
               r["measured"] / r["measure_s"] if r["measure_s"] else 0.0, r["peak_rss_bytes"],
               f"{len(r['shards_measured'])} shards, {r['measured']:,} records") for r in cold2],
            ("cold, 2 ranks together", two_wall, max(r["open_s"] for r in cold2), two_measure,
             sum(r["cpu_s"] for r in cold2), sample_records / two_measure, max(r["peak_rss_bytes"] for r in cold2),
             f"entries by rank {entries}"),
            ("warm, 1 rank, every shard", w["start_s"], w["open_s"], w["measure_s"], w["cpu_s"], 0.0,
             w["peak_rss_bytes"], f"{w['measured']} records measured, {w['records']:,} records, {w['packs']:,} "
             f"packs; process {w['process_s']:.1f} s with imports")]
    sample = "" if sample_shards == shards else (
        f"; cold measures on the first {sample_shards} shards ({sample_records:,} records), the other "
        f"{shards - sample_shards} shards' cache entries copied from the sample shard each is a link of "
        f"({fill[0]['copied']} entries in {fill[0]['copy_s']:.1f} s; opening the whole set, which indexes every "
        f"shard not yet indexed, {fill[0]['open_s']:.1f} s)")
    targets = {"warm_start_s": (w["start_s"], args.target_warm_s),
               "warm_rss_gib": (w["peak_rss_bytes"] / 2**30, args.target_rss_gib)}
    lines = [f"{records:,} records in {shards} WebDataset shards ({records // shards:,} a shard; shards past the "
             f"first {min(args.distinct, shards)} are hard links to them), recipe {RECIPE}, max_seq_len "
             f"{args.max_seq_len}; shards written in {write_s:.1f} s{sample}; load average at the start "
             f"{args.load_at_start:.2f}, at the end {os.getloadavg()[0]:.2f} (2 cores, shared)",
             "| phase | start s | open s | measure s | CPU s | records/s | peak RSS MiB | measured |",
             "|---|---|---|---|---|---|---|---|",
             *[f"| {name} | {start:.1f} | {opened:.1f} | {measure:.1f} | {cpu:.1f} | {rate:,.0f} | "
               f"{rss / 2**20:,.0f} | {what} |" for name, start, opened, measure, cpu, rate, rss, what in rows],
             f"2 ranks vs 1: measure {one['measure_s'] / two_measure:.2f}x faster (efficiency {efficiency:.0%}); "
             f"rank shares {[len(r['shards_measured']) for r in cold2]} shards",
             *[f"target {name} < {limit:g}: {value:.2f} {'OK' if value < limit else 'MISS'}"
               for name, (value, limit) in targets.items()],
             f"projection to {args.project_records:,} records ({project_shards:,.0f} shards of "
             f"{args.project_shard_records:,}) on {args.project_ranks} ranks, one measuring process each: "
             f"{projection['per_record_ms']:.2f} ms a record measured (wall), "
             f"{1e3 * one['cpu_s'] / sample_records:.2f} ms of CPU; cold measure "
             f"{projection['cold_measure_h_at_cpu_cost']:.2f} h at the CPU cost (a core per rank), "
             f"{projection['cold_measure_h_ideal']:.2f} h at this wall cost, "
             f"{projection['cold_measure_h_at_measured_efficiency']:.2f} h at this wall cost and the measured 2-rank "
             "efficiency; "
             f"warm start {projection['warm_start_s']:.0f} s (this warm start's fixed part, plus "
             f"{projection['warm_per_shard_ms']:.1f} ms a shard, its repeat's cost per shard of {records // shards:,} "
             f"records, times the shards, plus its plan's {1e6 * w['plan_s'] / w['records']:.1f} us a record times the "
             f"records: {projection['warm_plan_s']:.0f} s of planning)"]
    checks = {"cold_1": check_once(cold1, sample_records, sample_shards),
              "cold_2": check_once(cold2, sample_records, sample_shards),
              "warm_measured_none": w["measured"] == 0,
              # every shard is a link of one of the first ``distinct``: the whole set's tokens are the sample's times
              # the shards over the sample, when both hold each distinct shard equally often
              "warm_tokens": w["tokens"] == one["tokens"] * shards // sample_shards
              if shards % args.distinct == sample_shards % args.distinct == 0 else None,
              "same_packs": len({r["packs"] for r in (*cold1, *cold2, *(warm if sample_shards == shards else []))})
              == 1}
    lines.append(f"checks: each record measured once on 1 rank {checks['cold_1']['ok']}, on 2 ranks "
                 f"{checks['cold_2']['ok']}; warm start measured none {checks['warm_measured_none']}; every start "
                 f"over the same shards planned the same packs {checks['same_packs']}; the whole set's tokens "
                 f"{w['tokens']:,} are the sample's times {shards / sample_shards:g} {checks['warm_tokens']}")
    print("\n".join(lines))
    return {"lines": lines, "projection": projection, "checks": checks, "targets": targets, "cold_1": cold1,
            "cold_2": cold2, "fill": fill, "warm": warm}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--project-records", type=int, default=PROJECT_RECORDS)
    parser.add_argument("--project-ranks", type=int, default=PROJECT_RANKS)
    parser.add_argument("--project-shard-records", type=int, default=PROJECT_SHARD_RECORDS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--distinct", type=int, default=DISTINCT, help="shards written; the rest link to them")
    parser.add_argument("--cold-shards", type=int, default=None,
                        help="measure cold on the first N shards only (at least --distinct); default all")
    parser.add_argument("--target-warm-s", type=float, default=30.0)
    parser.add_argument("--target-rss-gib", type=float, default=2.0)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.phase:
        phase_main(args.phase)
        return None
    args.load_at_start = os.getloadavg()[0]
    sample = args.cold_shards or args.shards
    if not min(args.distinct, args.shards) <= sample <= args.shards:
        raise SystemExit(f"--cold-shards {sample}: at least --distinct {args.distinct} (their cache entries fill "
                         f"the linked shards') and at most --shards {args.shards}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_shards-"))
    try:
        started = time.perf_counter()
        source = write_shards(workdir, args.records, args.shards, args.seed, args.distinct)
        write_s = time.perf_counter() - started
        progress(f"shards: {source} ({write_s:.1f} s)")
        cold_source = shard_pattern(Path(source).parent, args.shards, sample)
        caches = {name: workdir / "caches" / name for name in ("cold-1", "cold-2")}
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
        cold1 = run_ranks("cold-1", 1, cold_source, caches["cold-1"], workdir, args)
        cold2 = run_ranks("cold-2", 2, cold_source, caches["cold-2"], workdir, args)
        entries = entries_by_rank(caches["cold-2"])
        fill = None
        if sample < args.shards:
            fill = run_ranks("fill", 1, source, caches["cold-2"], workdir, args,
                             fill={"distinct": args.distinct, "sample": sample})
        warm = run_ranks("warm", 1, source, caches["cold-2"], workdir, args)
        result = report(args, cold1, cold2, fill, warm, entries, write_s)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
