"""The embedded demo data set: synthetic shape images with questions only the image can answer.

Why it exists: tests, smoke runs and packing benchmarks need VLM SFT data that is offline, small, exactly
reproducible and shaped like the real thing (short samples dominate; the long tail is what makes packing matter).
Everything is drawn procedurally with PIL from ``random.Random(seed)`` (never the global RNG), and PNGs carry
no timestamps, so the same ``(num_samples, seed)`` gives byte-identical files on every machine with the same
Pillow/zlib.

Intended mix (fractions of ``num_samples``; the rare kinds get at least one record each once
``num_samples >= 8``; images are 56-448 px per side, square and not, i.e. ~4-256 visual tokens at 28 px
per token):

========================  ======  ==========================================================================
kind                      share   what it looks like
========================  ======  ==========================================================================
``single``                ~52%    one image, one question ("How many red circles are there?"), short answer
``multi_turn``            ~20%    one image, 2-4 question/answer rounds
``describe``              ~7%     one image, "Describe the image." with a 40-1200 word (log-uniform) description
``text_only``             ~10%    arithmetic / word questions, no image, 1-3 rounds
``multi_image``           ~10%    2-3 images, comparison questions ("Which image has more squares?")
``overlong``              ~1%     one image, an exhaustive 2,600-4,000 word description (> 2048 tokens)
========================  ======  ==========================================================================

A few single-image records have no ``<image>`` tag (the reader puts the image first, LLaVA convention), some
put the tag after the question, and ~15% carry a system turn, so readers and encoders see every variant.

With ``videos=True`` (for recipes whose encoder takes video; LLaVA's does not, so its demo has none) ~5% of the
records (at least one once ``num_samples >= 8``) are ``video`` records, LLaVA-Video style (``"video"`` + a
``<video>`` tag): a clip of 8-24 frames at 4-10 fps, 64-160 px per side, in which one shape moves from one place
to another past a still one, with questions about the motion ("Which way does the red circle move?"). Clips are
H.264 in MP4 (PyAV, one encoder thread, so the bytes are the same on every machine with the same PyAV), 2-10 KB
each. The rest of the mix keeps its kinds; the draws differ from the image-only set of the same seed.

Only an entry point writes it: :func:`with_demo_data` (what ``run_recipe`` and the tools call before anything
is built) fills an empty ``data.sources`` with it, in a folder of ``demo.out_dir`` named by its settings
(:func:`demo_dir`: ``.cache/demo/600_seed0``); building a ``Trainer`` writes no file.

CLI: ``python -m mvp_engine.engine.demo --out DIR [--num-samples N] [--seed S] [--videos]``.
"""

from .entry import demo_dir, with_demo_data
from .writer import JSONL_NAME, MANIFEST_NAME, demo_kind_counts, write_demo_dataset

__all__ = ["JSONL_NAME", "MANIFEST_NAME", "demo_dir", "demo_kind_counts", "with_demo_data", "write_demo_dataset"]
