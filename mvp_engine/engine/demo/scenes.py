"""Demo scenes: shapes on a plain canvas, drawn with PIL, and the facts a question about them needs."""

from __future__ import annotations

import io
import math
import random

from PIL import Image, ImageDraw

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


def position(cell: tuple[int, int]) -> str:
    return POSITIONS[cell[0]][cell[1]]


class Scene:
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


def render(scene: Scene) -> bytes:
    image = Image.new("RGB", (scene.width, scene.height), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = scene.width / 3, scene.height / 3
    for o in scene.objects:
        row, col = o["cell"]
        cx, cy = (col + 0.5) * cell_w, (row + 0.5) * cell_h
        r = o["scale"] * min(cell_w, cell_h) / 2
        draw_shape(draw, o["shape"], cx, cy, r, COLOURS[o["colour"]])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)  # no pnginfo: no tIME/text chunks, bytes depend on pixels
    return buffer.getvalue()


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple) -> None:
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
