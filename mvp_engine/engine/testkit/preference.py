"""Preference pairs for recipe checks: TRL-style and LLaMA-Factory-style records with real image files (a single-
turn image prompt, a multi-turn prompt with a system turn, a text-only pair), written as JSON, JSONL or parquet, and
the bad pairs every reader must count (``BAD_PAIRS``: reason -> record)."""

from __future__ import annotations

import json
from pathlib import Path

from .records import IMAGE_SIZES, write_image

BAD_PAIRS = {
    "missing_answer": {"id": "no-rejected", "prompt": "Say hi.", "chosen": "hi", "rejected": ""},
    "identical_answers": {"id": "same", "prompt": "Say hi.", "chosen": "hi there", "rejected": "hi there"},
}


def good_pairs(directory: Path) -> list[dict]:
    """Three pairs over two images in ``directory``: TRL single-turn with an image, LLaMA-Factory multi-turn with an
    image and a system prompt, TRL conversational text-only."""
    directory.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("wide", "square")):
        write_image(directory / f"{name}.png", *IMAGE_SIZES[name], seed=seed)
    return [
        {"id": "trl-img", "prompt": "What colour is the picture?", "images": ["wide.png"],
         "chosen": "Mostly noise in many colours.", "rejected": "Blue."},
        {"id": "lf-multi", "system": "Be brief.", "images": ["square.png"],
         "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."},
                           {"from": "human", "value": "Any shapes in it?"}],
         "chosen": {"from": "gpt", "value": "No clear shapes."},
         "rejected": {"from": "gpt", "value": "A cat sitting on a red mat, clearly."}},
        {"id": "trl-text", "prompt": [{"role": "user", "content": "Count to three."}],
         "chosen": [{"role": "assistant", "content": "one two three"}],
         "rejected": [{"role": "assistant", "content": "three"}]},
    ]


def write_pairs(directory: Path, suffix: str = ".jsonl", bad: bool = False, copies: int = 1) -> Path:
    """:func:`good_pairs` (``copies`` times over, ids ``<id>-<k>`` when more than once; then ``BAD_PAIRS`` with
    ``bad``) as ``pairs<suffix>`` (``.json``, ``.jsonl``, ``.parquet``) in ``directory``."""
    good = good_pairs(directory)
    if copies > 1:
        good = [{**pair, "id": f"{pair['id']}-{k}"} for k in range(copies) for pair in good]
    rows = good + (list(BAD_PAIRS.values()) if bad else [])
    path = directory / f"pairs{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # parquet columns have one type: answers and prompts as JSON text would lose the formats, so one
        # layout per file (the TRL string layout) is what a parquet set holds
        flat = [{"id": r["id"], "prompt": r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][0]["content"],
                 "chosen": r["chosen"] if isinstance(r["chosen"], str) else r["chosen"][0]["content"],
                 "rejected": r["rejected"] if isinstance(r["rejected"], str) else r["rejected"][0]["content"],
                 "images": r.get("images", [])} for r in rows if "prompt" in r]
        pq.write_table(pa.Table.from_pylist(flat), path)
    return path
