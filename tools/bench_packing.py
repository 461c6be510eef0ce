"""Packing efficiency and planning speed of each strategy on a seeded LLaVA-like length mix.

The mix (``llava_like_lengths``) imitates LLaVA-NeXT / Qwen2-VL style SFT data with dynamic-resolution images
(tokens per image lognormal around 576, sigma 0.5, clipped to [64, 2304]):
  70 % single-image chats: 1 image + lognormal text (median 110 tokens, sigma 0.8)
  15 % text-only chats:    lognormal (median 180, sigma 1.0)
  10 % multi-image chats:  2-4 images + lognormal text (median 150, sigma 0.7)
   5 % long conversations: lognormal (median 1500, sigma 0.6), the long tail
Lengths are clipped to [8, 2 * max_seq_len]; overlong samples are dropped by the planner and excluded from the
lower bound, which is ceil(sum of admitted lengths / max_seq_len).

Planning is training's: a dataset built by ``MLLMDataKit.build_dataset`` over one synthetic record per sample
(its encoder's ``measure`` reads the drawn length and image count) plans epoch 0 with ``dataset.plan(0)``:
admission, the epoch's shuffled record order, then the strategy. Measuring happens before the timer, as a run's
cached measure pass does; the timer covers admission and planning.

A second, informational line uses fixed 576-token images (LLaVA-1.5): almost every sample is then 600-1000
tokens and few items are small enough to fill the last gaps, so no packer reaches the lower bound there; the
line shows how far from it BFD stays on such data.

    python tools/bench_packing.py [--samples 1000000] [--max-seq-len 4096]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from mvp_engine.kit.mllm.data import MLLMDataKit, MLLMDataSpec, MLLMPackingSpec, MLLMRecord, SampleMeta

IMAGE_TOKENS = 576


def llava_like_lengths(n: int, max_seq_len: int, seed: int = 0,
                       image_token_sigma: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Seeded sample lengths and image counts following the mix in the module docstring."""
    rng = np.random.default_rng(seed)
    image_tokens = np.clip(rng.lognormal(math.log(IMAGE_TOKENS), image_token_sigma, n), 64, 2304).astype(np.int64)
    kind = rng.choice(4, size=n, p=[0.70, 0.15, 0.10, 0.05])
    images = np.select([kind == 0, kind == 2], [1, rng.integers(2, 5, size=n)], 0)
    text = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3],
        [rng.lognormal(math.log(110), 0.8, n), rng.lognormal(math.log(180), 1.0, n),
         rng.lognormal(math.log(150), 0.7, n), rng.lognormal(math.log(1500), 0.6, n)],
    )
    lengths = np.clip(images * image_tokens + text.astype(np.int64), 8, 2 * max_seq_len)
    return lengths.astype(np.int64), images.astype(np.int64)


class DrawnLengths:
    """The encoder of the synthetic records: record ``i`` measures as the ``i``-th drawn length and image count (it
    has no text or image to encode; planning never encodes)."""

    def __init__(self, lengths: list[int], media: list[int]):
        self.lengths, self.media = lengths, media

    def measure(self, record: MLLMRecord) -> SampleMeta:
        index = int(record.record_id)
        return SampleMeta(length=self.lengths[index], num_media=self.media[index])

    def encode(self, record: MLLMRecord):
        raise NotImplementedError("bench_packing plans; it never encodes a sample")


def planning_dataset(strategy: str, lengths: list[int], media: list[int], max_seq_len: int, seed: int = 0,
                     **spec_kwargs):
    """The dataset a training run with ``+packing=strategy`` builds over these samples, measured."""
    packing = MLLMPackingSpec(max_seq_len=max_seq_len, strategy=strategy, seed=seed, **spec_kwargs)
    records = [MLLMRecord(record_id=str(i), origin=f"synthetic:{i}", messages=[]) for i in range(len(lengths))]
    dataset = MLLMDataKit.build_dataset(MLLMDataSpec(packing=packing, max_seq_len=max_seq_len, seed=seed),
                                        DrawnLengths(lengths, media), records=records)
    dataset.metas  # noqa: B018  (measured before the timer, as a run's cached measure pass is)
    return dataset


def run(strategy: str, lengths: list[int], media: list[int], max_seq_len: int, seed: int = 0,
        **spec_kwargs) -> dict:
    dataset = planning_dataset(strategy, lengths, media, max_seq_len, seed, **spec_kwargs)
    start = time.perf_counter()
    plan = dataset.plan(0)
    seconds = time.perf_counter() - start
    admitted = int(plan.lengths[plan.admission.admitted_mask].sum())  # each admitted sample is in one pack
    lower_bound = math.ceil(admitted / max_seq_len)
    return {
        "strategy": strategy,
        "packs": len(plan.packs),
        "lower_bound": lower_bound,
        "ratio": len(plan.packs) / lower_bound,
        "fill": admitted / (len(plan.packs) * max_seq_len),
        "dropped": len(plan.dropped),
        "samples_per_s": len(lengths) / seconds,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths_np, media_np = llava_like_lengths(args.samples, args.max_seq_len, args.seed)
    lengths, media = lengths_np.tolist(), media_np.tolist()
    print(f"{args.samples:,} samples, max_seq_len {args.max_seq_len}, mean length {lengths_np.mean():.0f}, "
          f"p50 {np.median(lengths_np):.0f}, p99 {np.percentile(lengths_np, 99):.0f}")
    cases = [
        ("bfd", {"buffer_size": args.samples}, 1.001, 1_000_000),
        ("greedy", {"buffer_size": 1024, "max_open_packs": 64}, 1.02, 300_000),
    ]
    for strategy, kwargs, ratio_target, speed_target in cases:
        result = run(strategy, lengths, media, args.max_seq_len, args.seed, **kwargs)
        ok = result["ratio"] <= ratio_target and result["samples_per_s"] >= speed_target
        print(f"{strategy:7s} {kwargs}: packs {result['packs']:,} / lower bound {result['lower_bound']:,} = "
              f"{result['ratio']:.4f} (target <= {ratio_target}), fill {result['fill']:.4f}, "
              f"dropped {result['dropped']:,}, planning {result['samples_per_s']:,.0f} samples/s "
              f"(target >= {speed_target:,}) in {result['seconds']:.2f} s -> {'OK' if ok else 'MISS'}")
    fixed_lengths, fixed_media = llava_like_lengths(args.samples, args.max_seq_len, args.seed, image_token_sigma=0.0)
    result = run("bfd", fixed_lengths.tolist(), fixed_media.tolist(), args.max_seq_len, args.seed,
                 buffer_size=args.samples)
    print(f"info: bfd on fixed 576-token images (LLaVA-1.5 mix): packs / lower bound = {result['ratio']:.4f}, "
          f"fill {result['fill']:.4f}")


if __name__ == "__main__":
    main()
