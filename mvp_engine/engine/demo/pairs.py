"""The demo preference set: every demo conversation (``writer.py``) as a LLaMA-Factory-style pair whose chosen answer
is its own final answer and whose rejected answer is the next conversation's (a plausible answer to another
question, about another image): a signal a tiny model can learn, so the demo DPO run's reward margin and accuracy
move. Written beside the demo set as ``demo_pairs.jsonl`` (media paths stay relative to that folder)."""

from __future__ import annotations

import json
from pathlib import Path

PAIRS_NAME = "demo_pairs.jsonl"


def write_demo_pairs(demo_jsonl: str | Path) -> Path:
    """``demo_pairs.jsonl`` next to ``demo_jsonl`` (written once; rewritten when the demo set is newer)."""
    source = Path(demo_jsonl)
    out = source.with_name(PAIRS_NAME)
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    records = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = []
    for record, other in zip(records, records[1:] + records[:1]):
        turns, answer, wrong = record["conversations"], record["conversations"][-1], other["conversations"][-1]
        if answer["from"] != "gpt" or wrong["from"] != "gpt" or answer["value"] == wrong["value"]:
            continue
        pair = {key: value for key, value in record.items() if key != "conversations"}
        pair.update(conversations=turns[:-1], chosen=answer, rejected=wrong)
        lines.append(json.dumps(pair, ensure_ascii=False) + "\n")
    partial = out.with_suffix(".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(out)
    return out
