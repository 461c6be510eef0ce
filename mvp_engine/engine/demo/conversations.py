"""Demo conversations of every image and text kind: questions only the image can answer, true answers."""

from __future__ import annotations

import math
import random

from .scenes import COLOURS, SHAPES, Scene, position

SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about images.",
    "You are a careful visual assistant. Answer briefly and precisely.",
)



def _plural(word: str, n: int) -> str:
    return word if n == 1 else word + "s"


def _number(n: int) -> str:
    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    return words[n] if n < len(words) else str(n)


def _qa(rng: random.Random, scene: Scene) -> tuple[str, str]:
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
    where = position(cell)
    if found is None:
        return f"What shape is in the {where} of the image?", f"There is nothing in the {where}."
    return f"What shape is in the {where} of the image?", f"A {found['colour']} {found['shape']}."


def _where_answer(scene: Scene, shape: str, colour: str) -> str:
    places = [position(o["cell"]) for o in scene.objects if o["shape"] == shape and o["colour"] == colour]
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
    scene = Scene(rng)
    question, answer = _qa(rng, scene)
    return [{"from": "human", "value": _image_turn(rng, question)}, {"from": "gpt", "value": answer}], [scene]


def _multi_turn(rng: random.Random):
    scene = Scene(rng, min_objects=2)
    turns = []
    for k in range(rng.randint(2, 4)):
        question, answer = _qa(rng, scene)
        turns.append({"from": "human", "value": _image_turn(rng, question) if k == 0 else question})
        turns.append({"from": "gpt", "value": answer})
    return turns, [scene]


def _description(rng: random.Random, scene: Scene, target_words: int) -> str:
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
        sentences.append(f"In the {position(o['cell'])} there is a {o['colour']} {o['shape']}.")
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
            pos=position(o["cell"]),
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
    scene = Scene(rng)
    prompt = rng.choice(("Describe the image.", "What do you see in this picture?", "Give a detailed description."))
    # Log-uniform 40-1200 words: the tail between short QA and the overlong records (~60-1600 tokens).
    target = round(math.exp(rng.uniform(math.log(40), math.log(1200))))
    text = _description(rng, scene, target)
    return [{"from": "human", "value": _image_turn(rng, prompt)}, {"from": "gpt", "value": text}], [scene]


def _overlong(rng: random.Random):
    scene = Scene(rng, min_objects=3)
    text = _description(rng, scene, rng.randint(2600, 4000))
    prompt = "Describe the image in exhaustive detail, every shape and every position."
    return [{"from": "human", "value": f"<image>\n{prompt}"}, {"from": "gpt", "value": text}], [scene]


def _multi_image(rng: random.Random):
    scenes = [Scene(rng) for _ in range(rng.randint(2, 3))]
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


# record kind -> builder of its turns (LLaVA style) and the scenes its images show
IMAGE_KINDS = {
    "single": _single,
    "multi_turn": _multi_turn,
    "describe": _describe,
    "text_only": _text_only,
    "multi_image": _multi_image,
    "overlong": _overlong,
}


def with_system_turn(rng: random.Random, turns: list[dict]) -> list[dict]:
    """~15% of the records open with a system turn, so readers and encoders see that variant too."""
    if rng.random() < 0.15:
        return [{"from": "system", "value": rng.choice(SYSTEM_PROMPTS)}] + turns
    return turns
