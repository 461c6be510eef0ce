"""``train.context_parallel_size``: the names this module used to hold, kept importable. The layout, its one device
mesh, ``parallelize`` and the sequence-parallel forward of one micro-batch live in ``parallel.py``."""

from .parallel import (  # noqa: F401
    ParallelLayout,
    build_layout,
    make_sequence_parallel,
    media_keys,
    row_multiple,
    sequence_parallel_forward,
)
