"""Demo-like records for recipe checks: real image files written with PIL, OpenAI-style messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from mvp_engine.kit.mllm.data import MLLMRecord

IMAGE_SIZES = {"wide": (60, 90), "square": (40, 40), "tall": (120, 50), "small": (20, 30)}  # (height, width)


def write_image(path: Path, height: int, width: int, seed: int) -> str:
    rng = np.random.RandomState(seed)
    Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return str(path)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(path: str) -> dict:
    return {"type": "image", "path": path}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def assistant(t: str) -> dict:
    return {"role": "assistant", "content": [text(t)]}


def system(t: str) -> dict:
    return {"role": "system", "content": [text(t)]}


def write_images(directory: Path) -> dict[str, str]:
    """The four fixture images (wide, square, tall, small) as PNG files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return {name: write_image(directory / f"{name}.png", h, w, seed)
            for seed, (name, (h, w)) in enumerate(IMAGE_SIZES.items())}


def demo_like_records(directory: Path) -> list[MLLMRecord]:
    """Image samples, text-only samples and a multi-image, multi-turn sample, in this order:
    ``img0``, ``txt0``, ``multi``, ``txt1``, ``img1``."""
    images = write_images(directory)
    return [
        MLLMRecord("img0", "fixture.jsonl:1", [user(image(images["wide"]), text("What colour is it?")),
                                               assistant("It is red.")]),
        MLLMRecord("txt0", "fixture.jsonl:2", [user(text("Count to three.")), assistant("one two three")]),
        MLLMRecord("multi", "fixture.jsonl:3", [user(image(images["square"]), text("And this?")),
                                                assistant("A square."),
                                                user(image(images["tall"]), image(images["small"]), text("Now?")),
                                                assistant("A tall box and a small dot.")]),
        MLLMRecord("txt1", "fixture.jsonl:4", [system("Be brief."), user(text("Why is the sky blue?")),
                                               assistant("Because of light.")]),
        MLLMRecord("img1", "fixture.jsonl:5", [user(text("Describe:"), image(images["small"])),
                                               assistant("A small picture.")]),
    ]


def varied_records(directory: Path) -> list[MLLMRecord]:
    """Many records over many image sizes (tiny, huge, extreme aspect ratios, a greyscale JPEG) and layouts (text
    only, one image, two images, system + multi-turn with images in later turns), for measure == encode checks."""
    directory.mkdir(parents=True, exist_ok=True)
    sizes = [(10, 10), (28, 28), (56, 56), (60, 90), (90, 60), (200, 300), (300, 200), (800, 300), (28, 600),
             (33, 47), (500, 500), (57, 113)]
    paths = [write_image(directory / f"im{i}.png", h, w, i) for i, (h, w) in enumerate(sizes)]
    paths.append(str(directory / "im.jpg"))
    Image.new("L", (77, 45), 128).save(paths[-1])  # greyscale JPEG
    records = []
    for i in range(len(paths) * 2):
        p, q = paths[i % len(paths)], paths[(i * 5 + 1) % len(paths)]
        kind = i % 5
        if kind == 0:
            msgs = [user(text(f"Question {i}?")), assistant(f"Answer {i}.")]
        elif kind == 1:
            msgs = [user(image(p), text("What is this?")), assistant("A shape.")]
        elif kind == 2:
            msgs = [user(image(p), image(q), text("Compare.")), assistant("Two images.")]
        elif kind == 3:
            msgs = [system("You count things."), user(text("Hi"), image(p)), assistant("Hello."), user(image(q)),
                    assistant("Another one.")]
        else:
            msgs = [user(text("a")), assistant("b"), user(text("c")), assistant("d e f")]
        records.append(MLLMRecord(f"r{i}", f"many.jsonl:{i}", msgs))
    return records


def write_mixed_jsonl(directory: Path, num_records: int = 11) -> Path:
    """A LLaVA-style JSONL file that alternates image and text-only records of varied lengths: run unpacked with
    one sample per micro-batch, neighbouring ranks get one image micro-batch and one without media at the same
    step (what breaks DDP without the dummy media pass). ``num_records`` odd: the last step is uneven."""
    images = write_images(directory / "images")
    names = list(images)
    lines = []
    for i in range(num_records):
        words = " ".join(f"w{(i * 7 + j) % 23}" for j in range(3 + (i * 5) % 11))
        if i % 2:
            conversation = [{"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": words}]
            lines.append({"id": f"text{i}", "conversations": conversation})
        else:
            conversation = [{"from": "human", "value": f"<image>\nWhat is {i}?"}, {"from": "gpt", "value": words}]
            lines.append({"id": f"image{i}", "image": images[names[i % len(names)]], "conversations": conversation})
    path = directory / "mixed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _truncated_png(path: Path, seed: int) -> str:
    """A PNG whose header reads fine but whose body is cut: only decoding finds the fault."""
    write_image(path, 64, 64, seed)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


# fault class -> what the record looks like (LLaVA style); images are written by write_messy_jsonl
MESSY_FAULTS = ("invalid_json", "invalid_record", "missing_image", "empty_turn", "leading_assistant",
                "unplaced_image", "conflicting_system", "unreadable_image", "corrupt_image")


def _messy_line(i: int, fault: str | None, images: dict[str, str], directory: Path) -> str:
    ask = {"from": "human", "value": f"<image>\nWhat is shape {i}?"}
    answer = {"from": "gpt", "value": f"Shape number {i} is a square."}
    record: dict = {"id": f"rec{i}", "image": images["square"], "conversations": [ask, answer]}
    if fault is None and i % 3 == 0:
        record = {"id": f"rec{i}", "conversations": [{"from": "human", "value": f"Say {i}."}, answer]}
    elif fault == "invalid_json":
        return json.dumps({"id": f"rec{i}"})[:-1] + ', "conversations": ['  # cut mid-record
    elif fault == "invalid_record":
        record = {"id": f"rec{i}", "dialogue": []}
    elif fault == "missing_image":
        record["image"] = str(directory / "images" / f"absent{i}.png")
    elif fault == "empty_turn":
        record["conversations"] = [ask, {"from": "gpt", "value": "   \n"}]
    elif fault == "leading_assistant":
        record["conversations"] = [answer, ask, answer]
    elif fault == "unplaced_image":
        record = {"id": f"rec{i}", "images": [images["square"], images["wide"]], "conversations": [ask, answer]}
    elif fault == "conflicting_system":
        record["system"] = "Be brief."
        record["conversations"] = [{"from": "system", "value": "Be verbose."}, ask, answer]
    elif fault == "unreadable_image":
        garbage = directory / "images" / f"garbage{i}.png"
        garbage.write_bytes(b"not an image at all")
        record["image"] = str(garbage)
    elif fault == "corrupt_image":
        record["image"] = _truncated_png(directory / "images" / f"cut{i}.png", i)
    return json.dumps(record)


def write_messy_jsonl(directory: Path, num_records: int = 300, bad_every: int = 3) -> tuple[Path, dict[str, str]]:
    """A LLaVA-style JSONL mix where every ``bad_every``-th record carries one of :data:`MESSY_FAULTS` in turn
    (image and text-only records otherwise). Returns the file and the expected fault of each bad record by origin."""
    images = write_images(directory / "images")
    path = directory / "messy.jsonl"
    expected, lines = {}, []
    for i in range(num_records):
        fault = MESSY_FAULTS[(i // bad_every) % len(MESSY_FAULTS)] if i % bad_every == bad_every - 1 else None
        lines.append(_messy_line(i, fault, images, directory))
        if fault:
            expected[f"{path}:{i + 1}"] = fault
    path.write_text("".join(line + "\n" for line in lines))
    return path, expected
