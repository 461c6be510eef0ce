"""Validate a recipe's packed behaviour: one line per check, PASS or FAIL, with the numbers behind it.

Why: a packing bug rarely crashes. A mask that lets samples see each other, a knob the spec never reads or a step
count that drifts from the run all train "fine" and silently change what was learned. Each check measures one
link of the data flow on the recipe's own encoder, tiny model and demo data, and prints the evidence, so a review
can quote numbers instead of adjectives. The checks are the testkit's (``mvp_engine.engine.testkit.validate``);
this is their command line.

    python tools/validate_recipe.py qwen2_vl
    python tools/validate_recipe.py llava +packing=bfd data.max_seq_len=512 demo.num_samples=40
    python tools/validate_recipe.py qwen2_vl --hard
    PYTHONPATH=. python tools/validate_recipe.py llava --recipe-module tests.fixtures.broken_recipe.train

``<recipe>`` names ``conf/<recipe>.yaml`` and ``recipes/<recipe>``; the ``Recipe`` validated is ``RECIPE`` of
``recipes.<recipe>.train``, or of ``--recipe-module`` (a test fixture, a recipe under development: importable, so
a module outside the installed packages needs ``PYTHONPATH``). Hydra overrides after the name apply to the
composed config, after the testkit's small defaults (``DEFAULT_OVERRIDES``: a 32-record demo set in a temp dir,
``data.max_seq_len=512``, micro-batches of 2, 2 epochs; ``+packing=greedy`` unless a ``+packing=...`` is given).

Soft checks (in process):

- ``packing-knobs``: every key of every ``conf/packing/*.yaml`` is a field of ``MLLMPackingSpec`` and each yaml
  extends ``packing_schema`` (the dataclass holds the defaults); the composed ``packing`` node reaches the spec value
  for value.
- ``custom-assembler``: ``MLLMPackingSpec(assembler_cls="mvp_engine.engine.testkit.data_checks.NextFitAssembler")``
  plans the recipe's real demo metadata with that class (next-fit boundaries verified, drops equal the built-in's).
- ``pack-fields``: the first packs the dataset serves carry ``pack_segment_ids`` and ``source_sample_num`` that
  match the plan (segment lengths, restarting positions, -100 first labels, ``cu_seqlens``).
- ``collator-padding``: the run's ``MLLMCollator`` pads real packs and an empty one with the inactive values.
- ``model-preparation``: the testkit's ``run_equivalence`` (the check ``tools/check_packed_equivalence.py`` runs)
  on two real packs of the demo plan, for every backend of the recipe this machine runs; flash kwargs through
  ``sdpa_varlen`` on CPU where flash cannot run. Packed logits, loss and gradients must equal one-by-one ones. A
  hybrid model (linear-attention layers, Qwen3.5) also runs with its linear-attention boundaries withheld, which
  must cost more than ``LEAK_FLOOR`` (1e-2): the check provably sees a state or conv-window leak.
- ``accounting``: a counted pass over every epoch through the run's own loader and collator
  (``TokenAccounting.from_batch``) against the plan, the engine's plan report (``batch_accounting``: the slots)
  and ``dataset.estimate_total_steps``.

``--hard`` adds the seed's hard checks as subprocesses: ``compileall`` of the DataKit and the recipe, then the
recipe's ``tests/test_structure.py`` and ``tests/test_smoke.py``.

Exit code: 0 when every check passes, 1 when any fails, 2 when validation cannot start (config error, no recipe).
``main(argv)`` returns that code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra.errors import HydraException

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.testing import first_line, validate_recipe, validation_config


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="conf/<recipe>.yaml and recipes/<recipe>")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +packing=bfd data.max_seq_len=512")
    parser.add_argument("--hard", action="store_true", help="also run compileall and the structure and smoke tests")
    parser.add_argument("--recipe-module", default=None,
                        help="module whose RECIPE is validated (default recipes.<recipe>.train)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine two OpenMP threads made "
                             "the tiny model's forwards 10-100x slower at random)")
    return parser.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="validate_recipe_") as workdir:
            cfg = with_demo_data(validation_config(args.recipe, args.overrides, Path(workdir)))
            results = validate_recipe(args.recipe, cfg, args.recipe_module, args.hard,
                                      emit=lambda line: print(line, flush=True))
    except (ConfigError, HydraException, ModuleNotFoundError) as err:
        print(f"cannot validate: {first_line(err)}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # called in process (tests), leave the caller's setting as it was
    failed = [r.name for r in results if not r.ok]
    print(f"result: {len(results) - len(failed)}/{len(results)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
