"""Check that a recipe's packed forward/backward equals one-by-one forwards/backwards, from the command line.

The same check as the recipes' ``test_packed_equivalence.py`` (``mvp_engine.engine.testing.run_equivalence``):
real demo-like records (images written with PIL to a temp dir) encoded by the recipe, packed into two padded rows
by the DataKit, run through the recipe's ``prepare_packed`` on the tiny model, compared with each sample alone.
Prints the max logit difference of every segment, the loss difference and the max relative gradient difference;
exits 1 when anything is over the tolerance (1e-5 in fp32), 2 when this machine cannot run the backend.

    python tools/check_packed_equivalence.py --recipe llava --attention flex_attention
    python tools/check_packed_equivalence.py --recipe qwen2_vl --attention eager
    python tools/check_packed_equivalence.py --recipe qwen3_5 --attention sdpa --withhold-linear-boundaries

``--withhold-linear-boundaries`` (hybrid models, Qwen3.5) runs the recipe's hook without the linear-attention
boundaries: the report must then FAIL (exit 1) with logit differences over 1e-2, showing what the check catches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from mvp_engine.engine.config import ATTENTION_BACKENDS, ConfigError, check_attention
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.testing import equivalence_case, run_equivalence, without_linear_boundaries


def main(argv: list[str] | None = None, prepare_packed: Callable | None = None) -> int:
    """``prepare_packed`` replaces the recipe's hook (tests pass a deliberately broken one to see exit code 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipes/<name>")
    parser.add_argument("--attention", default="sdpa", choices=ATTENTION_BACKENDS)
    parser.add_argument("--tol", type=float, default=None, help="default: 1e-5 in fp32 (3e-2 for bf16 flash)")
    parser.add_argument("--withhold-linear-boundaries", action="store_true",
                        help="drop the linear-attention boundaries (hybrid models): the check must fail")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe)
    if args.withhold_linear_boundaries:
        prepare_packed = without_linear_boundaries(prepare_packed or recipe.prepare_packed)
    try:
        check_attention(args.attention, recipe.attention_backends, training=False)
    except ConfigError as err:
        print(f"cannot check: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        case = equivalence_case(args.recipe, Path(workdir))
        report = run_equivalence(case, args.attention, prepare_packed=prepare_packed, tol=args.tol)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
