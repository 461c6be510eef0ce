"""Tokens and vision work per preference pair: the prefix shared (one packing item holding the prompt and its images
once, both answers after it) against the prefix duplicated (each answer after its own copy of the prompt), measured
on a preference set through the run's own encoder, from text and image headers alone (``PairEncoder.measure``).

Why: packed DPO is worth doing with the prompt shared only if it saves work; the target (issue 32) is >= 1.5x fewer
tokens processed per pair than duplicating the prefix, on a set with image prompts and short answers. The loss is
the same either way (``tests/test_dpo_packed.py`` checks shared == duplicated == pair by pair).

Usage: ``python tools/bench_pairs.py --recipe llava [--pairs pairs.jsonl] [overrides ...]``; without ``--pairs`` the
demo preference set (``demo.*`` overrides apply: the demo set as LLaMA-Factory pairs, each conversation's own answer
chosen, the next one's rejected). Prints, per layout, tokens per pair and image tokens per pair (what the vision
tower encodes), and the ratios.
"""

from __future__ import annotations

import argparse
import statistics

from mvp_engine.engine.config import compose_config
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.kit.mllm.data.pairs import PairEncoder
from mvp_engine.kit.mllm.data.preference_sources import read_preference_records
from mvp_engine.kit.mllm.data.sources import MLLMRecordError


def measure(recipe_name: str, pairs_path: str | None, overrides: list[str]) -> dict[str, dict[str, float]]:
    cfg = compose_config(recipe_name, ["train.objective=dpo", *overrides])
    if pairs_path is not None:
        cfg.data.sources = [pairs_path]
    cfg = with_demo_data(cfg)
    recipe = load_recipe(recipe_name)
    encoder = recipe.build_encoder(recipe.build_processor(cfg.model))
    records = [r for source in cfg.data.sources for r in read_preference_records(source, on_bad=lambda err: None)]
    out = {}
    for name, shared in (("shared", True), ("duplicated", False)):
        pair_encoder = PairEncoder(encoder, shared_prefix=shared)
        metas = []
        for record in records:
            try:
                metas.append(pair_encoder.measure(record))
            except MLLMRecordError:
                continue
        out[name] = {"pairs": len(metas), "tokens": statistics.fmean(m.length for m in metas),
                     "image_tokens": statistics.fmean(m.media_tokens for m in metas)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="llava")
    parser.add_argument("--pairs", default=None, help="a preference file (default: the demo preference set)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (demo.num_samples=200, model.*, ...)")
    args = parser.parse_args(argv)
    result = measure(args.recipe, args.pairs, args.overrides)
    shared, duplicated = result["shared"], result["duplicated"]
    print(f"{args.recipe}: {shared['pairs']} pairs measured")
    print(f"{'layout':<12}{'tokens/pair':>14}{'image tokens/pair':>20}")
    for name, row in result.items():
        print(f"{name:<12}{row['tokens']:>14.1f}{row['image_tokens']:>20.1f}")
    tokens_ratio = duplicated["tokens"] / shared["tokens"]
    image_ratio = duplicated["image_tokens"] / shared["image_tokens"] if shared["image_tokens"] else float("nan")
    verdict = "OK" if tokens_ratio >= 1.5 else "MISS"
    print(f"duplicated / shared: tokens {tokens_ratio:.2f}x (target >= 1.5x: {verdict}), image tokens "
          f"{image_ratio:.2f}x")


if __name__ == "__main__":
    main()
