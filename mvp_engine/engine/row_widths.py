"""The collator a run pads its micro-batches with: the trainer, evaluation, the plan report and the benches build it
here, so the widths a report counts are the widths a run trains on."""

from __future__ import annotations

from collections.abc import Callable

from mvp_engine.kit.mllm.data import MLLMCollator
from mvp_engine.packing import flex_row_widths
from mvp_engine.packing.backends import FLEX

from .config import RunSpecs
from .device import cuda_in_use
from .parallel import row_multiple


def run_collator(pad_token_id: int, specs: RunSpecs, cp_size: int = 1,
                 metadata: Callable[[dict], dict] | None = None) -> MLLMCollator:
    """Rows padded to a multiple of ``train.pad_to_multiple_of`` and of the CP size (``row_multiple``). Under
    flex_attention with ``train.pad_to_multiple_of`` null, to the widths of ``flex_row_widths`` up to
    ``data.max_seq_len`` besides (powers of two on CUDA, the one top width elsewhere): flex runs a kernel compiled
    for the batch's shapes, so they must repeat; a set multiple is taken as the user's choice of widths.
    ``metadata``: what the collator adds to each batch on the CPU (``Recipe.packed_metadata``)."""
    train = specs.train
    widths = (flex_row_widths(specs.data.max_seq_len, cuda_in_use())
              if specs.attention == FLEX and train.pad_to_multiple_of is None else ())
    return MLLMCollator(pad_token_id, row_multiple(train.pad_to_multiple_of, cp_size), widths, metadata)
