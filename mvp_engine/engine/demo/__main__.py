"""``python -m mvp_engine.engine.demo --out DIR``: write the demo data set and say what is in it."""

from __future__ import annotations

import argparse
import json

from .writer import MANIFEST_NAME, write_demo_dataset


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
