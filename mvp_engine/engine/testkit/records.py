"""Demo-like records for recipe checks: real image files written with PIL, tiny clips written with PyAV,
OpenAI-style messages."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
from PIL import Image

from mvp_engine.kit.mllm.data import MLLMRecord

IMAGE_SIZES = {"wide": (60, 90), "square": (40, 40), "tall": (120, 50), "small": (20, 30)}  # (height, width)


def write_image(path: Path, height: int, width: int, seed: int) -> str:
    rng = np.random.RandomState(seed)
    Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return str(path)


def write_video(path: Path, num_frames: int, height: int, width: int, seed: int, fps: int = 10,
                codec: str = "libx264", faststart: bool = False) -> str:
    """A random-noise clip (``codec``: ``libx264`` or ``mpeg4`` in ``.mp4``, ``libvpx`` in ``.webm``, whose container
    states no frame count); sides even, as yuv420p needs. ``faststart`` writes an mp4's index before the frames."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(num_frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return str(path)


def write_frame_folder(directory: Path, num_frames: int, height: int, width: int, seed: int) -> str:
    """A frame folder: ``num_frames`` PNG files named so that only a numeric sort orders them right."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_frames):
        write_image(directory / f"frame_{i + 1}.png", height, width, seed + i)
    return str(directory)


def write_broken_videos(directory: Path) -> dict[str, str]:
    """One clip per video fault, keyed by the reason it is counted under: a file that is no video
    (``unreadable_video``, found by measure), frame data zeroed behind an intact header (``corrupt_video``, found
    by decoding) and an mp4 whose index, written first, promises 20 frames of which the file holds about half
    (``video_measure_mismatch``, found by decoding)."""
    directory.mkdir(parents=True, exist_ok=True)
    garbage = directory / "garbage.mp4"
    garbage.write_bytes(b"not a video at all" * 20)
    zeroed = Path(write_video(directory / "zeroed.mp4", 12, 48, 64, seed=8))
    data = bytearray(zeroed.read_bytes())
    start = data.index(b"mdat") + 8
    data[start : start + 2000] = bytes(2000)
    zeroed.write_bytes(bytes(data))
    cut = Path(write_video(directory / "cut.mp4", 20, 32, 32, seed=9, codec="mpeg4", faststart=True))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    return {"unreadable_video": str(garbage), "corrupt_video": str(zeroed), "video_measure_mismatch": str(cut)}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(path: str) -> dict:
    return {"type": "image", "path": path}


def video(path: str, fps: float | None = None) -> dict:
    return {"type": "video", "path": path} if fps is None else {"type": "video", "path": path, "fps": fps}


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


def video_record(directory: Path) -> MLLMRecord:
    """``vid0``: a short clip, a question and an answer, for recipes whose encoder takes video."""
    directory.mkdir(parents=True, exist_ok=True)
    clip = write_video(directory / "clip.mp4", num_frames=12, height=48, width=64, seed=7)
    return MLLMRecord("vid0", "fixture.jsonl:6", [user(video(clip), text("What moves?")), assistant("Noise moves.")])


def varied_video_records(directory: Path) -> list[MLLMRecord]:
    """Clips of several lengths, rates, sizes and containers (h264 and mpeg4 mp4, webm without a frame count, a
    frame folder with and without a given fps, one frame only), alone, together and next to images."""
    directory.mkdir(parents=True, exist_ok=True)
    clips = [write_video(directory / "a.mp4", 30, 48, 64, 0, fps=15),
             write_video(directory / "b.mp4", 7, 90, 40, 1, fps=4, codec="mpeg4"),
             write_video(directory / "c.webm", 25, 34, 120, 2, fps=25, codec="libvpx"),
             write_video(directory / "d.mp4", 1, 60, 60, 3),
             write_frame_folder(directory / "frames", 11, 30, 50, 4)]
    picture = write_image(directory / "picture.png", 40, 70, 5)
    return [
        *(MLLMRecord(f"v{i}", f"videos.jsonl:{i}", [user(video(c), text("What happens?")), assistant("A change.")])
          for i, c in enumerate(clips)),
        MLLMRecord("fps", "videos.jsonl:5", [user(text("Look:"), video(clips[4], fps=8)), assistant("Slow.")]),
        MLLMRecord("mix", "videos.jsonl:6", [user(image(picture), video(clips[0]), text("Same?")), assistant("No."),
                                             user(video(clips[2]), video(clips[1])), assistant("Two more.")]),
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
