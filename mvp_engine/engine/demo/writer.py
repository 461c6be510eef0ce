"""Writing the demo data set: its records and media files, reproducibly, once per arguments.

Output: ``<out>/demo.jsonl`` (LLaVA style, image and clip paths relative to it), ``<out>/images/*.png``,
``<out>/videos/*.mp4`` and ``<out>/demo_manifest.json``; the manifest is written last and makes a repeated call
with the same arguments a no-op. Every file is written atomically (temp file + rename), so ranks racing to create
the same data set never read a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from pathlib import Path

from .clips import moving_shape_clip
from .conversations import IMAGE_KINDS, with_system_turn
from .scenes import render

# Bump whenever the output for a given (num_samples, seed) changes, so existing directories are regenerated.
GENERATOR_VERSION = 1
JSONL_NAME = "demo.jsonl"
MANIFEST_NAME = "demo_manifest.json"
IMAGE_DIR = "images"
VIDEO_DIR = "videos"

KIND_SHARES = {"multi_turn": 0.20, "describe": 0.07, "text_only": 0.10, "multi_image": 0.10, "overlong": 0.01}
VIDEO_SHARE = 0.05  # the ``video`` kind, with ``videos=True``


def write_demo_dataset(out_dir: str | os.PathLike, num_samples: int = 600, seed: int = 0,
                       videos: bool = False) -> Path:
    """Write the demo data set into ``out_dir`` and return the JSONL path; a no-op if it is already there.
    ``videos``: the mix gains ``video`` records with short generated clips."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out = Path(out_dir)
    jsonl = out / JSONL_NAME
    if _is_complete(out, num_samples, seed, videos):
        return jsonl
    records, files, kinds = _generate(num_samples, seed, videos)
    for folder, pattern in ((IMAGE_DIR, "demo-*.png"), (VIDEO_DIR, "demo-*.mp4")):
        (out / folder).mkdir(parents=True, exist_ok=True)
        wanted = {Path(rel).name for rel in files if rel.startswith(f"{folder}/")}
        for stale in (out / folder).glob(pattern):
            if stale.name not in wanted:
                stale.unlink(missing_ok=True)
    for rel, data in files.items():
        _write_atomic(out / rel, data)
    body = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
    _write_atomic(jsonl, body)
    manifest = {
        "generator_version": GENERATOR_VERSION,
        "num_samples": num_samples,
        "seed": seed,
        "jsonl_sha256": hashlib.sha256(body).hexdigest(),
        "images": sorted(rel for rel in files if rel.startswith(f"{IMAGE_DIR}/")),
        "kinds": dict(sorted(Counter(kinds).items())),
    }
    if videos:  # only then: an image-only manifest stays what it always was
        manifest["videos"] = sorted(rel for rel in files if rel.startswith(f"{VIDEO_DIR}/"))
    _write_atomic(out / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
    return jsonl


def demo_kind_counts(num_samples: int, videos: bool = False) -> dict[str, int]:
    """How many records of each kind ``write_demo_dataset`` produces for ``num_samples`` (seed-independent)."""
    shares = {**KIND_SHARES, **({"video": VIDEO_SHARE} if videos else {})}
    counts = {kind: round(share * num_samples) for kind, share in shares.items()}
    if num_samples >= 8:
        counts = {kind: max(1, count) for kind, count in counts.items()}
    counts["single"] = num_samples - sum(counts.values())
    if counts["single"] < 0:  # tiny data sets: keep the order of importance, drop what does not fit
        counts = {"single": num_samples}
    return counts


def _is_complete(out: Path, num_samples: int, seed: int, videos: bool) -> bool:
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        if (manifest["generator_version"], manifest["num_samples"], manifest["seed"], "videos" in manifest) != (
            GENERATOR_VERSION,
            num_samples,
            seed,
            videos,
        ):
            return False
        body = (out / JSONL_NAME).read_bytes()
        if hashlib.sha256(body).hexdigest() != manifest["jsonl_sha256"]:
            return False
        return all((out / rel).is_file() for rel in manifest["images"] + manifest.get("videos", []))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _generate(num_samples: int, seed: int, videos: bool = False) -> tuple[list[dict], dict[str, bytes], list[str]]:
    """The records, every media file (path relative to the output folder -> bytes) and each record's kind."""
    plan_rng = random.Random(seed)
    kinds = [kind for kind, count in demo_kind_counts(num_samples, videos).items() for _ in range(count)]
    plan_rng.shuffle(kinds)
    records: list[dict] = []
    files: dict[str, bytes] = {}
    for index, kind in enumerate(kinds):
        rng = random.Random(seed * 1_000_003 + index * 7919 + 17)
        record_id = f"demo-{index:05d}"
        out = {"id": record_id}
        if kind == "video":
            record, clip = moving_shape_clip(rng)
            out["video"] = f"{VIDEO_DIR}/{record_id}.mp4"
            files[out["video"]] = clip
            scenes = []
        else:
            record, scenes = IMAGE_KINDS[kind](rng)
        names = []
        for k, scene in enumerate(scenes):
            rel = f"{IMAGE_DIR}/{record_id}" + (f"-{k}" if len(scenes) > 1 else "") + ".png"
            files[rel] = render(scene)
            names.append(rel)
        if len(names) == 1:
            out["image"] = names[0]
        elif names:
            out["images"] = names
        out["conversations"] = with_system_turn(rng, record)
        records.append(out)
    return records, files, kinds
