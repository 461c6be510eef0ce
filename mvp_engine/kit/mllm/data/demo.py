"""The embedded demo data set: synthetic shape images with questions only the image can answer.

Why it exists: tests, smoke runs and packing benchmarks need VLM SFT data that is offline, small, exactly
reproducible and shaped like the real thing (short samples dominate; the long tail is what makes packing matter).
Everything is drawn procedurally with PIL from ``random.Random(seed)`` (never the global RNG), and PNGs carry
no timestamps, so the same ``(num_samples, seed)`` gives byte-identical files on every machine with the same
Pillow/zlib.

Intended mix (fractions of ``num_samples``; the rare kinds get at least one record each once
``num_samples >= 8``; images are 56-448 px per side, square and not, i.e. ~4-256 visual tokens at 28 px
per token):

========================  ======  ==========================================================================
kind                      share   what it looks like
========================  ======  ==========================================================================
``single``                ~52%    one image, one question ("How many red circles are there?"), short answer
``multi_turn``            ~20%    one image, 2-4 question/answer rounds
``describe``              ~7%     one image, "Describe the image." with a 40-1200 word (log-uniform) description
``text_only``             ~10%    arithmetic / word questions, no image, 1-3 rounds
``multi_image``           ~10%    2-3 images, comparison questions ("Which image has more squares?")
``overlong``              ~1%     one image, an exhaustive 2,600-4,000 word description (> 2048 tokens)
========================  ======  ==========================================================================

A few single-image records have no ``<image>`` tag (the reader puts the image first, LLaVA convention), some
put the tag after the question, and ~15% carry a system turn, so readers and encoders see every variant.

With ``videos=True`` (for recipes whose encoder takes video; LLaVA's does not, so its demo has none) ~5% of the
records (at least one once ``num_samples >= 8``) are ``video`` records, LLaVA-Video style (``"video"`` + a
``<video>`` tag): a clip of 8-24 frames at 4-10 fps, 64-160 px per side, in which one shape moves from one place
to another past a still one, with questions about the motion ("Which way does the red circle move?"). Clips are
H.264 in MP4 (PyAV, one encoder thread, so the bytes are the same on every machine with the same PyAV), 2-10 KB
each. The rest of the mix keeps its kinds; the draws differ from the image-only set of the same seed.

Output: ``<out>/demo.jsonl`` (LLaVA style, image and clip paths relative to it), ``<out>/images/*.png``,
``<out>/videos/*.mp4`` and ``<out>/demo_manifest.json``; the manifest is written last and makes a repeated call
with the same arguments a no-op. Every file is written atomically (temp file + rename), so ranks racing to create
the same data set never read a half-written file.

CLI: ``python -m mvp_engine.kit.mllm.data.demo --out DIR [--num-samples N] [--seed S] [--videos]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import random
from collections import Counter
from pathlib import Path

import av
from PIL import Image, ImageDraw

# Bump whenever the output for a given (num_samples, seed) changes, so existing directories are regenerated.
GENERATOR_VERSION = 1
JSONL_NAME = "demo.jsonl"
MANIFEST_NAME = "demo_manifest.json"
IMAGE_DIR = "images"
VIDEO_DIR = "videos"

KIND_SHARES = {"multi_turn": 0.20, "describe": 0.07, "text_only": 0.10, "multi_image": 0.10, "overlong": 0.01}
VIDEO_SHARE = 0.05  # the ``video`` kind, with ``videos=True``

SHAPES = ("circle", "square", "triangle", "star", "diamond")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 170),
    "orange": (245, 130, 30),
    "black": (20, 20, 20),
}
BACKGROUNDS = {"white": (255, 255, 255), "light grey": (225, 225, 225), "cream": (250, 243, 224)}
POSITIONS = (
    ("top-left", "top", "top-right"),
    ("left", "centre", "right"),
    ("bottom-left", "bottom", "bottom-right"),
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about images.",
    "You are a careful visual assistant. Answer briefly and precisely.",
)


# --- public API ------------------------------------------------------------------------------------------------


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


# --- completeness / files ------------------------------------------------------------------------------------


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


# --- generation ----------------------------------------------------------------------------------------------


def _generate(num_samples: int, seed: int, videos: bool = False) -> tuple[list[dict], dict[str, bytes], list[str]]:
    """The records, every media file (path relative to the output folder -> bytes) and each record's kind."""
    plan_rng = random.Random(seed)
    kinds = [kind for kind, count in demo_kind_counts(num_samples, videos).items() for _ in range(count)]
    plan_rng.shuffle(kinds)
    records: list[dict] = []
    files: dict[str, bytes] = {}
    builders = {
        "single": _single,
        "multi_turn": _multi_turn,
        "describe": _describe,
        "text_only": _text_only,
        "multi_image": _multi_image,
        "overlong": _overlong,
    }
    for index, kind in enumerate(kinds):
        rng = random.Random(seed * 1_000_003 + index * 7919 + 17)
        record_id = f"demo-{index:05d}"
        out = {"id": record_id}
        if kind == "video":
            record, clip = _video(rng)
            out["video"] = f"{VIDEO_DIR}/{record_id}.mp4"
            files[out["video"]] = clip
            scenes = []
        else:
            record, scenes = builders[kind](rng)
        names = []
        for k, scene in enumerate(scenes):
            rel = f"{IMAGE_DIR}/{record_id}" + (f"-{k}" if len(scenes) > 1 else "") + ".png"
            files[rel] = _render(scene)
            names.append(rel)
        if len(names) == 1:
            out["image"] = names[0]
        elif names:
            out["images"] = names
        conversations = record
        if rng.random() < 0.15:
            conversations = [{"from": "system", "value": rng.choice(SYSTEM_PROMPTS)}] + conversations
        out["conversations"] = conversations
        records.append(out)
    return records, files, kinds


class _Scene:
    """A canvas and the objects on it: everything a question or a description needs to be correct."""

    def __init__(self, rng: random.Random, min_objects: int = 1, max_objects: int = 7) -> None:
        self.width, self.height = _canvas_size(rng)
        self.background = rng.choice(sorted(BACKGROUNDS))
        count = rng.randint(min_objects, max_objects)
        cells = rng.sample([(r, c) for r in range(3) for c in range(3)], count)
        # Few colours/shapes per image, so counting questions have interesting answers.
        shapes = rng.sample(SHAPES, rng.randint(1, 3))
        colours = rng.sample(sorted(COLOURS), rng.randint(1, 3))
        self.objects = [
            {"shape": rng.choice(shapes), "colour": rng.choice(colours), "cell": cell, "scale": rng.uniform(0.55, 0.9)}
            for cell in sorted(cells)
        ]

    def count(self, shape: str | None = None, colour: str | None = None) -> int:
        return sum(
            1
            for o in self.objects
            if (shape is None or o["shape"] == shape) and (colour is None or o["colour"] == colour)
        )

    def at(self, cell: tuple[int, int]) -> dict | None:
        return next((o for o in self.objects if o["cell"] == cell), None)


def _canvas_size(rng: random.Random) -> tuple[int, int]:
    """Log-uniform sides in [56, 448]: many small images, some large; a third square, the rest not."""
    side = round(math.exp(rng.uniform(math.log(56), math.log(448))))
    if rng.random() < 1 / 3:
        return side, side
    other = round(side * math.exp(rng.uniform(math.log(0.5), math.log(2.0))))
    other = min(448, max(56, other))
    return (side, other) if rng.random() < 0.5 else (other, side)


def _render(scene: _Scene) -> bytes:
    image = Image.new("RGB", (scene.width, scene.height), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = scene.width / 3, scene.height / 3
    for o in scene.objects:
        row, col = o["cell"]
        cx, cy = (col + 0.5) * cell_w, (row + 0.5) * cell_h
        r = o["scale"] * min(cell_w, cell_h) / 2
        _draw_shape(draw, o["shape"], cx, cy, r, COLOURS[o["colour"]])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)  # no pnginfo: no tIME/text chunks, bytes depend on pixels
    return buffer.getvalue()


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=fill)
    else:  # star
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=fill)


# --- questions -----------------------------------------------------------------------------------------------


def _plural(word: str, n: int) -> str:
    return word if n == 1 else word + "s"


def _number(n: int) -> str:
    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    return words[n] if n < len(words) else str(n)


def _position(cell: tuple[int, int]) -> str:
    return POSITIONS[cell[0]][cell[1]]


def _qa(rng: random.Random, scene: _Scene) -> tuple[str, str]:
    """One question about the scene and its correct answer."""
    kind = rng.choice(("count_both", "count_shape", "count_all", "colour_of", "shape_at", "is_there", "where"))
    obj = rng.choice(scene.objects)
    if kind == "count_both":
        shape, colour = (obj["shape"], obj["colour"]) if rng.random() < 0.8 else (rng.choice(SHAPES), obj["colour"])
        n = scene.count(shape, colour)
        verb = "is" if n == 1 else "are"
        return f"How many {colour} {shape}s are there?", f"There {verb} {_number(n)} {colour} {_plural(shape, n)}."
    if kind == "count_shape":
        shape = rng.choice(SHAPES)
        n = scene.count(shape)
        return f"How many {shape}s are in the image?", f"{_number(n).capitalize()}."
    if kind == "count_all":
        n = len(scene.objects)
        verb = "is" if n == 1 else "are"
        return "How many shapes are there in total?", f"There {verb} {_number(n)} {_plural('shape', n)} in total."
    if kind == "colour_of" and scene.count(obj["shape"]) == 1:
        return f"What colour is the {obj['shape']}?", f"The {obj['shape']} is {obj['colour']}."
    if kind == "is_there":
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        n = scene.count(shape, colour)
        answer = f"Yes, there {'is' if n == 1 else 'are'} {_number(n)}." if n else f"No, there is no {colour} {shape}."
        return f"Is there a {colour} {shape} in the image?", answer
    if kind == "where":
        return (
            f"Where is the {obj['colour']} {obj['shape']}?"
            if scene.count(obj["shape"], obj["colour"]) == 1
            else f"Where are the {obj['colour']} {obj['shape']}s?",
            _where_answer(scene, obj["shape"], obj["colour"]),
        )
    cell = (rng.randrange(3), rng.randrange(3))
    found = scene.at(cell)
    where = _position(cell)
    if found is None:
        return f"What shape is in the {where} of the image?", f"There is nothing in the {where}."
    return f"What shape is in the {where} of the image?", f"A {found['colour']} {found['shape']}."


def _where_answer(scene: _Scene, shape: str, colour: str) -> str:
    places = [_position(o["cell"]) for o in scene.objects if o["shape"] == shape and o["colour"] == colour]
    if len(places) == 1:
        return f"It is in the {places[0]}."
    return "They are in the " + ", ".join(places[:-1]) + f" and {places[-1]}."


def _image_turn(rng: random.Random, question: str) -> str:
    """Where the ``<image>`` tag goes: mostly first, sometimes after the question, rarely absent."""
    roll = rng.random()
    if roll < 0.05:
        return question
    if roll < 0.2:
        return f"{question}\n<image>"
    return f"<image>\n{question}"


def _single(rng: random.Random):
    scene = _Scene(rng)
    question, answer = _qa(rng, scene)
    return [{"from": "human", "value": _image_turn(rng, question)}, {"from": "gpt", "value": answer}], [scene]


def _multi_turn(rng: random.Random):
    scene = _Scene(rng, min_objects=2)
    turns = []
    for k in range(rng.randint(2, 4)):
        question, answer = _qa(rng, scene)
        turns.append({"from": "human", "value": _image_turn(rng, question) if k == 0 else question})
        turns.append({"from": "gpt", "value": answer})
    return turns, [scene]


def _description(rng: random.Random, scene: _Scene, target_words: int) -> str:
    """A faithful description, padded with more (still true) observations until it reaches ``target_words``."""
    n = len(scene.objects)
    orientation = "square" if scene.width == scene.height else ("wide" if scene.width > scene.height else "tall")
    sentences = [
        (
            f"The image is a {orientation} {scene.width} by {scene.height} pixel picture on a {scene.background} "
            f"background, showing {_number(n)} {_plural('shape', n)}."
        )
    ]
    for o in scene.objects:
        sentences.append(f"In the {_position(o['cell'])} there is a {o['colour']} {o['shape']}.")
    templates = (
        "Looking again at the {pos}, the {colour} {shape} takes up most of its part of the picture.",
        "The {colour} {shape} in the {pos} has clean, sharp edges against the {bg} background.",
        "Nothing overlaps the {colour} {shape} in the {pos}; it stands on its own.",
        "Compared with its neighbours, the {colour} {shape} in the {pos} is {size} in size.",
        "Counting once more, there {are} {count} {colour} {shapes} in the whole image, one of them in the {pos}.",
        "The {bg} background around the {shape} in the {pos} is plain, with no texture or gradient.",
        "An observer scanning from the top-left would reach the {colour} {shape} in the {pos} at step {step}.",
    )
    words = sum(len(s.split()) for s in sentences)
    step = 0
    while words < target_words:
        o = rng.choice(scene.objects)
        count = scene.count(o["shape"], o["colour"])
        step += 1
        sentence = rng.choice(templates).format(
            pos=_position(o["cell"]),
            colour=o["colour"],
            shape=o["shape"],
            shapes=_plural(o["shape"], count),
            bg=scene.background,
            size="large" if o["scale"] > 0.75 else ("medium" if o["scale"] > 0.65 else "small"),
            are="is" if count == 1 else "are",
            count=_number(count),
            step=step,
        )
        sentences.append(sentence)
        words += len(sentence.split())
    paragraphs, current = [], []
    for sentence in sentences:
        current.append(sentence)
        if len(current) >= rng.randint(4, 8):
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def _describe(rng: random.Random):
    scene = _Scene(rng)
    prompt = rng.choice(("Describe the image.", "What do you see in this picture?", "Give a detailed description."))
    # Log-uniform 40-1200 words: the tail between short QA and the overlong records (~60-1600 tokens).
    target = round(math.exp(rng.uniform(math.log(40), math.log(1200))))
    text = _description(rng, scene, target)
    return [{"from": "human", "value": _image_turn(rng, prompt)}, {"from": "gpt", "value": text}], [scene]


def _overlong(rng: random.Random):
    scene = _Scene(rng, min_objects=3)
    text = _description(rng, scene, rng.randint(2600, 4000))
    prompt = "Describe the image in exhaustive detail, every shape and every position."
    return [{"from": "human", "value": f"<image>\n{prompt}"}, {"from": "gpt", "value": text}], [scene]


def _multi_image(rng: random.Random):
    scenes = [_Scene(rng) for _ in range(rng.randint(2, 3))]
    ordinals = ("first", "second", "third")
    shape = rng.choice(SHAPES)
    counts = [s.count(shape) for s in scenes]
    if rng.random() < 0.5:
        tags = "".join(f"Image {k + 1}: <image>\n" for k in range(len(scenes)))
    else:
        tags = "<image>" * len(scenes) + "\n"
    question = f"Which image has more {shape}s?" if len(scenes) == 2 else f"Which image has the most {shape}s?"
    best = max(counts)
    winners = [k for k, c in enumerate(counts) if c == best]
    tally = ", ".join(f"{_number(c)} in the {ordinals[k]}" for k, c in enumerate(counts))
    if len(winners) == 1:
        answer = f"The {ordinals[winners[0]]} image ({tally})."
    else:
        answer = f"None has more: the counts tie ({tally})."
    turns = [{"from": "human", "value": tags + question}, {"from": "gpt", "value": answer}]
    if rng.random() < 0.4:
        totals = [len(s.objects) for s in scenes]
        turns.append({"from": "human", "value": "How many shapes are there in each image?"})
        answer = "; ".join(f"{ordinals[k]}: {_number(t)}" for k, t in enumerate(totals))
        turns.append({"from": "gpt", "value": answer[0].upper() + answer[1:] + "."})
    return turns, scenes


_WORDS = ("triangle", "purple", "packing", "sequence", "vision", "language", "gradient", "token", "circle", "window")


def _text_only(rng: random.Random):
    turns = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.choice(("add", "mul", "sub", "reverse", "letters", "sort"))
        if kind == "add":
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            q, a_ = f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
        elif kind == "mul":
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            q, a_ = f"What is {a} times {b}?", f"{a} × {b} = {a * b}."
        elif kind == "sub":
            a, b = rng.randint(100, 999), rng.randint(2, 99)
            q, a_ = f"Subtract {b} from {a}.", f"{a} - {b} = {a - b}."
        elif kind == "reverse":
            word = rng.choice(_WORDS)
            q, a_ = f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."
        elif kind == "letters":
            word = rng.choice(_WORDS)
            q, a_ = f"How many letters are in the word '{word}'?", f"'{word}' has {len(word)} letters."
        else:
            numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 7))]
            q = "Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers)) + "."
            a_ = ", ".join(map(str, sorted(numbers))) + "."
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a_}]
    return turns, []


# --- video ---------------------------------------------------------------------------------------------------


def _video(rng: random.Random) -> tuple[list[dict], bytes]:
    """A clip in which one shape moves from one cell to another past a still one, and questions about it."""
    width, height = (2 * rng.randint(32, 80) for _ in range(2))  # even sides: H.264's yuv420p needs them
    frames, fps = rng.randint(8, 24), rng.choice((4, 6, 8, 10))
    background = rng.choice(sorted(BACKGROUNDS))
    shape, still_shape = rng.sample(SHAPES, 2)
    colour, still_colour = rng.sample(sorted(COLOURS), 2)
    start, end, still = rng.sample([(r, c) for r in range(3) for c in range(3)], 3)
    cell_w, cell_h = width / 3, height / 3
    radius = 0.4 * min(cell_w, cell_h)
    pictures = []
    for k in range(frames):
        t = k / (frames - 1)
        row, col = (a + (b - a) * t for a, b in zip(start, end))
        image = Image.new("RGB", (width, height), BACKGROUNDS[background])
        draw = ImageDraw.Draw(image)
        _draw_shape(draw, still_shape, (still[1] + 0.5) * cell_w, (still[0] + 0.5) * cell_h, radius,
                    COLOURS[still_colour])
        _draw_shape(draw, shape, (col + 0.5) * cell_w, (row + 0.5) * cell_h, radius, COLOURS[colour])
        pictures.append(image)
    qa = [(f"Which way does the {colour} {shape} move?", f"It moves from the {_position(start)} to the "
           f"{_position(end)}."),
          ("What colour is the moving shape?", f"It is {colour}; the {still_colour} {still_shape} stays still."),
          ("Describe the video.", f"On a {background} background a {colour} {shape} moves from the "
           f"{_position(start)} to the {_position(end)} in {frames / fps:.1f} seconds, past a {still_colour} "
           f"{still_shape} that does not move.")]
    rng.shuffle(qa)
    turns = []
    for k, (question, answer) in enumerate(qa[: rng.choice((1, 1, 2))]):
        tagged = f"<video>\n{question}" if rng.random() < 0.85 else f"{question}\n<video>"
        turns += [{"from": "human", "value": tagged if k == 0 else question}, {"from": "gpt", "value": answer}]
    return turns, _encode_clip(pictures, fps)


def _encode_clip(pictures: list[Image.Image], fps: int) -> bytes:
    """H.264 in MP4, one encoder thread (x264's output depends on its thread count)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = pictures[0].width, pictures[0].height, "yuv420p"
        stream.codec_context.thread_count = 1
        for picture in pictures:
            container.mux(stream.encode(av.VideoFrame.from_image(picture)))
        container.mux(stream.encode())
    return buffer.getvalue()


# --- CLI -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the reproducible demo VLM data set (LLaVA JSONL + PNGs).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-samples", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--videos", action="store_true", help="add short generated clips to the mix")
    args = parser.parse_args(argv)
    path = write_demo_dataset(args.out, num_samples=args.num_samples, seed=args.seed, videos=args.videos)
    counts = json.loads((path.parent / MANIFEST_NAME).read_text(encoding="utf-8"))["kinds"]
    summary = ", ".join(f"{kind}={count}" for kind, count in counts.items())
    print(f"{path}  ({args.num_samples} records, seed {args.seed}; {summary})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
