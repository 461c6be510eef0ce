"""Build the small, committed tokenizer assets the recipes load instead of a hub download.

No model hub is reachable, so every recipe trains from a tokenizer we generate here: a byte-level BPE learned
on a fixed, seedless corpus written in this file (shapes, colours, counting, questions and answers, plus some
general English), extended with the model family's special tokens and chat template, and saved with
``save_pretrained`` so ``AutoTokenizer.from_pretrained(dir)`` loads it like a real checkpoint's tokenizer.

Running the script twice gives byte-identical files (tested): the corpus is enumerated in a fixed order, BPE
training is deterministic for a fixed corpus, and JSON is written with sorted keys.

The tokenizers themselves are the model families': every ``recipes/<package>/tokens.py`` (a recipe's or a family
package's) may declare ``TOKENIZERS``, asset name -> ``build(train_bpe)``, which trains its vocabulary with this
file's :func:`train_bpe` (on the shared ``corpus()``) and returns the tokenizer with its special tokens and chat
template; this tool finds them (:func:`builders`) and writes each to ``assets/tokenizers/<name>``. A new recipe adds
its entry there, not here.

    python tools/build_tokenizer_assets.py                 # all tokenizers into assets/tokenizers/<name>/
    python tools/build_tokenizer_assets.py --only qwen2_vl --out /tmp/tok
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "assets" / "tokenizers"

SHAPES = ["circle", "square", "triangle", "rectangle", "star", "line", "dot", "box", "ring", "cross"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "gray", "brown"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
PLACES = ["left", "right", "top", "bottom", "center", "corner", "middle", "edge"]
SIZES = ["small", "large", "big", "tiny", "huge", "medium"]

GENERAL_TEXT = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, but a good answer needs
only a few. You are a helpful assistant. Please describe the image in detail. What do you see in this picture?
There is a cat sitting on the table next to a cup of tea. The sky is clear and the sun is shining brightly.
In the morning the children walk to school, and in the evening they come back home to eat dinner together.
Could you tell me how many objects are in the image? Yes, I can. There are several objects of different
colours and sizes. Describe the scene: a person is reading a book under a tree while birds sing above.
The answer is correct. That is not right; please look again and count carefully. Thank you very much!
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 25, 100 and 2024 appear in text as well as words.
Questions often start with what, where, when, which, who, why or how, and answers often start with it, there
or the. This is a test of a very small language model that learns from packed sequences of images and text.
"""

# A bank of common English words; ``corpus()`` strings them into simple sentences in a fixed order so BPE sees
# enough distinct words to learn a few thousand merges.
NOUNS = """
time year people way day man woman child world life hand part place case week company system program question
work government number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end member law car city
community name president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy music market sense nation plan college interest death experience effect class control care
field development role effort rate heart drug show leader light voice wife police mind price report decision son
view relationship town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece land product doctor wall patient
worker news test movie north love support technology step baby computer type attention film tree source organization
hair window evidence population site truth garden river mountain island forest ocean bird fish horse apple bread
cheese flower chair bottle cup plate kitchen train plane ship bridge station shadow pattern shape colour color
""".split()
VERBS = """
is was are be have do say go can get make know think take see come want look use find give tell work call try ask
need feel become leave put mean keep let begin seem help talk turn start show hear play run move like live believe
hold bring happen write provide sit stand lose pay meet include continue set learn change lead understand watch
follow stop create speak read allow add spend grow open walk win offer remember love consider appear buy wait serve
die send expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull count draw
paint describe notice point hide jump fly swim climb carry push throw catch hold break fix clean cook eat drink sleep
""".split()
ADJECTIVES = """
good new first last long great little own other old right big high different small large next early young important
few public bad same able free sure clear full special easy whole strong real best hard better true recent certain
personal open simple short dark bright round square flat sharp soft heavy light empty quiet happy sad warm cold hot
fast slow close far deep wide narrow thin thick clean dirty rich poor safe wild calm busy strange famous modern
""".split()
ADVERBS = "quickly slowly carefully quietly clearly nearly almost always never often sometimes together again".split()

QUESTIONS = [
    "What colour is the {shape}?",
    "How many {shape}s are there?",
    "Where is the {colour} {shape}?",
    "Is there a {colour} {shape} in the image?",
    "Describe the {size} {shape}.",
    "Which shape is {colour}?",
    "Count the {colour} shapes.",
]
ANSWERS = [
    "The {shape} is {colour}.",
    "There are {number} {shape}s.",
    "The {colour} {shape} is at the {place}.",
    "Yes, there is a {size} {colour} {shape} at the {place}.",
    "No, I do not see a {colour} {shape}.",
    "It is a {size} {colour} {shape} near the {place} of the image.",
]


def corpus() -> list[str]:
    """The fixed training corpus: templated Q&A lines in a fixed enumeration order plus general English."""
    lines = [line for line in GENERAL_TEXT.splitlines() if line]
    grid = itertools.product(SHAPES, COLOURS, NUMBERS, PLACES, SIZES)
    for i, (shape, colour, number, place, size) in enumerate(grid):
        if i % 7:  # a deterministic thinning keeps training fast; every word still appears many times
            continue
        fields = {"shape": shape, "colour": colour, "number": number, "place": place, "size": size}
        question = QUESTIONS[i % len(QUESTIONS)].format(**fields)
        answer = ANSWERS[i % len(ANSWERS)].format(**fields)
        lines.append(f"{question} {answer}")
        lines.append(f"{answer.capitalize()} {i % 1000} {place.upper()}")
    for i in range(len(NOUNS) * 4):
        noun, other = NOUNS[i % len(NOUNS)], NOUNS[(i * 7 + 3) % len(NOUNS)]
        verb, adj = VERBS[(i * 5 + 1) % len(VERBS)], ADJECTIVES[(i * 3 + 2) % len(ADJECTIVES)]
        adverb = ADVERBS[i % len(ADVERBS)]
        lines.append(f"The {adj} {noun} will {verb} the {other} {adverb}, and {other}s {verb} {noun}s.")
        lines.append(f"Why does the {noun} {verb}? Because {adj} {other}s are {adverb} {adj}er than {noun}s.")
    for verb in VERBS:
        lines.extend([f"{verb.capitalize()} it: {verb}s, {verb}ing and {verb}ed."] * 2)
    for word in NOUNS + ADJECTIVES:
        lines.extend([f"{word.capitalize()}? {word.upper()}! ({word}) {word}ly '{word}'"] * 2)
    return lines


def train_bpe(
    special_tokens: list[str],
    vocab_size: int,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    normalizer: normalizers.Normalizer | None = None,
    initial_alphabet: list[str] | None = None,
    model: models.Model | None = None,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a BPE ``model`` (default: plain ``models.BPE()``) on ``corpus()``; returns ``(vocab, merges)`` with
    the special tokens at ids 0..k-1, in the order given."""
    tokenizer = Tokenizer(model if model is not None else models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=initial_alphabet or [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return state["vocab"], merges


def _canonicalise_json(directory: Path) -> None:
    """Rewrite every JSON file with sorted keys so repeated builds are byte-identical."""
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(tokenizer, out_dir: Path) -> None:
    """``save_pretrained`` into a scratch folder, canonicalise, then replace ``out_dir`` file by file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        _canonicalise_json(Path(tmp))
        for stale in out_dir.iterdir():
            if stale.is_file():
                stale.unlink()
        for path in sorted(Path(tmp).iterdir()):
            (out_dir / path.name).write_bytes(path.read_bytes())


def builders() -> dict[str, Callable]:
    """Every tokenizer the recipes and family packages declare (``TOKENIZERS`` of ``recipes/<package>/tokens.py``),
    by asset name; a name declared twice is refused."""
    found: dict[str, Callable] = {}
    for path in sorted((REPO_ROOT / "recipes").glob("*/tokens.py")):
        module = importlib.import_module(f"recipes.{path.parent.name}.tokens")
        for name, build in getattr(module, "TOKENIZERS", {}).items():
            if name in found:
                raise ValueError(f"tokenizer {name!r} is declared twice (again in {module.__name__})")
            found[name] = build
    return found


def main(argv: list[str] | None = None) -> None:
    found = builders()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent folder; one sub-folder per tokenizer")
    parser.add_argument("--only", choices=sorted(found), action="append", help="build only these (repeatable)")
    args = parser.parse_args(argv)
    for name in args.only or sorted(found):
        _save(found[name](train_bpe), args.out / name)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
