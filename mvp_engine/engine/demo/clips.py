"""Demo clips: one shape moving past a still one, H.264 in MP4, and questions about the motion."""

from __future__ import annotations

import io
import random

import av
from PIL import Image, ImageDraw

from .scenes import BACKGROUNDS, COLOURS, SHAPES, draw_shape, position


def moving_shape_clip(rng: random.Random) -> tuple[list[dict], bytes]:
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
        draw_shape(draw, still_shape, (still[1] + 0.5) * cell_w, (still[0] + 0.5) * cell_h, radius,
                    COLOURS[still_colour])
        draw_shape(draw, shape, (col + 0.5) * cell_w, (row + 0.5) * cell_h, radius, COLOURS[colour])
        pictures.append(image)
    qa = [(f"Which way does the {colour} {shape} move?", f"It moves from the {position(start)} to the "
           f"{position(end)}."),
          ("What colour is the moving shape?", f"It is {colour}; the {still_colour} {still_shape} stays still."),
          ("Describe the video.", f"On a {background} background a {colour} {shape} moves from the "
           f"{position(start)} to the {position(end)} in {frames / fps:.1f} seconds, past a {still_colour} "
           f"{still_shape} that does not move.")]
    rng.shuffle(qa)
    turns = []
    for k, (question, answer) in enumerate(qa[: rng.choice((1, 1, 2))]):
        tagged = f"<video>\n{question}" if rng.random() < 0.85 else f"{question}\n<video>"
        turns += [{"from": "human", "value": tagged if k == 0 else question}, {"from": "gpt", "value": answer}]
    return turns, _encode_clip(pictures, fps)


def _encode_clip(pictures: list[Image.Image], fps: int) -> bytes:
    """H.264 in MP4 at a constant quantizer, one encoder thread: x264's output depends on its thread count, and its
    default rate control (CRF with macroblock-tree lookahead) gave two different files for the same frames in about
    one of ten clips encoded repeatedly in one process (measured); a constant QP gave one file in 480 encodes."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"qp": "23"})
        stream.width, stream.height, stream.pix_fmt = pictures[0].width, pictures[0].height, "yuv420p"
        stream.codec_context.thread_count = 1
        for picture in pictures:
            container.mux(stream.encode(av.VideoFrame.from_image(picture)))
        container.mux(stream.encode())
    return buffer.getvalue()
