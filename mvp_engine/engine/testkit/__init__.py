"""The recipe test kit: reusable checks a recipe's tests call in a few lines, so every recipe meets one contract.

This package is the kit's public entry point (``mvp_engine.engine.testing`` re-exports it under its older name);
the checks live in its modules:

- ``structure``: the entry point, hooks and encoder are in place; every packing x attention combination composes
  and validates (or fails naming the key where this machine cannot run it).
- ``smoke``: a few real training steps per packing strategy: finite, falling loss; accounting reconciles with the
  plan; estimated == actual steps (``check_smoke_summary``).
- ``equivalence``: packed == one-by-one (logits per segment, token-mean loss, parameter gradients) on real encoded
  records packed by the DataKit, for every backend this machine runs; the flash kwargs through a CPU reference;
  a hybrid model's linear-attention boundaries withheld must be caught
  (``check_withheld_linear_boundaries_are_caught``).
- ``encoders``: measure == encode, assistant-only labels, errors naming the record, the encoding equal to the
  family's transformers processor's (``check_encoder_matches_processor``), save/load round trip, a reproducible
  tokenizer asset, no torchvision needed.
- ``participation``: declared-unreachable parameters really get no gradient; the dummy media pass reaches every
  media parameter with an exact zero.
- ``recompute``: activation checkpointing gives the same loss and gradients on the packed case, and really
  recomputes (every layer runs again in backward; fewer bytes saved for backward).
- ``launch``: real ``python -m`` / torchrun launches of a recipe, their metrics, summaries and final weights.
- ``runs``: the same trainings without a fresh interpreter each (one process in the test's, several in a pool of
  rank workers, or forked ranks for a test to kill), a session cache of reference runs, and one shared mixed data
  set.
- ``records``: demo-like records with real image files (and tiny clips written with PyAV).
- ``validate``: every soft check of ``tools/validate_recipe.py`` on a recipe's real run (``data_checks``,
  ``model_checks``), one ``PASS|FAIL name: evidence`` line each, and the seed's hard checks.
- ``suites``: ready-made pytest classes over all of the above (``from mvp_engine.engine.testkit.suites import
  SmokeSuite``); kept out of this module so importing the kit does not import pytest.
"""

from ..config import CONF_DIR
from .context_parallel import (
    SplitReport,
    check_split_row_equivalence,
    check_split_training,
    split_inside_media,
)
from .encoders import (
    EncoderVideoProcessor,
    ProcessorComparison,
    check_assistant_only_labels,
    check_bad_records_name_origin,
    check_encoder_matches_processor,
    check_measure_equals_encode,
    check_no_torchvision,
    check_save_load_round_trip,
    check_tokenizer_asset,
    transformers_processor,
)
from .equivalence import (
    LEAK_FLOOR,
    TOL,
    EquivalenceCase,
    EquivalenceReport,
    check_flash_kwargs_with_reference_attention,
    check_withheld_linear_boundaries_are_caught,
    collate_rows,
    equivalence_case,
    run_equivalence,
    without_linear_boundaries,
)
from .evidence import CheckResult, first_line
from .launch import LAUNCH_ENV, final_weights, launch, max_weight_difference, read_metrics, read_summary
from .participation import check_dummy_media_pass, check_unreachable_parameters_are_unreachable
from .recipe_run import validation_config
from .recompute import RECOMPUTE_TOL, RecomputeReport, run_recompute_check
from .records import (
    assistant,
    demo_like_records,
    image,
    system,
    text,
    user,
    varied_records,
    varied_video_records,
    video,
    video_record,
    write_broken_videos,
    write_frame_folder,
    write_image,
    write_mixed_jsonl,
    write_video,
)
from .runs import ForkedRun, RankPool, cached_run, shared_mixed_jsonl, start_forked, train
from .smoke import check_smoke_summary, smoke_run
from .structure import (
    PACKINGS,
    backward_available,
    check_all_combinations_compose,
    check_structure,
    compose_config,
    forward_backends,
    load_recipe,
    needs_cuda,
    packing_overrides,
    runnable_backends,
)
from .validate import hard_commands, validate_recipe

__all__ = [
    "SplitReport",
    "check_split_row_equivalence",
    "check_split_training",
    "split_inside_media",
    "CONF_DIR",
    "LAUNCH_ENV",
    "LEAK_FLOOR",
    "PACKINGS",
    "RECOMPUTE_TOL",
    "TOL",
    "CheckResult",
    "EquivalenceCase",
    "EncoderVideoProcessor",
    "EquivalenceReport",
    "ProcessorComparison",
    "RecomputeReport",
    "assistant",
    "backward_available",
    "check_all_combinations_compose",
    "check_assistant_only_labels",
    "check_bad_records_name_origin",
    "check_encoder_matches_processor",
    "check_dummy_media_pass",
    "check_flash_kwargs_with_reference_attention",
    "check_measure_equals_encode",
    "check_no_torchvision",
    "check_save_load_round_trip",
    "check_smoke_summary",
    "check_structure",
    "check_tokenizer_asset",
    "check_unreachable_parameters_are_unreachable",
    "check_withheld_linear_boundaries_are_caught",
    "collate_rows",
    "compose_config",
    "demo_like_records",
    "equivalence_case",
    "final_weights",
    "first_line",
    "forward_backends",
    "hard_commands",
    "image",
    "launch",
    "ForkedRun",
    "RankPool",
    "cached_run",
    "shared_mixed_jsonl",
    "start_forked",
    "train",
    "load_recipe",
    "max_weight_difference",
    "needs_cuda",
    "packing_overrides",
    "read_metrics",
    "read_summary",
    "run_equivalence",
    "run_recompute_check",
    "runnable_backends",
    "smoke_run",
    "system",
    "text",
    "transformers_processor",
    "user",
    "validate_recipe",
    "validation_config",
    "varied_records",
    "varied_video_records",
    "video",
    "video_record",
    "write_broken_videos",
    "write_frame_folder",
    "write_image",
    "write_mixed_jsonl",
    "without_linear_boundaries",
    "write_video",
]
