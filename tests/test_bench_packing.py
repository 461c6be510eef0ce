"""tools/bench_packing.py on a small mix: it plans the way training does (a DataKit dataset's ``plan(0)``: admission,
the epoch's record order, then the strategy) and its numbers follow from that plan. Wall-clock values are never
asserted."""

from __future__ import annotations

import math

import pytest

from tools import bench_packing as bench

SAMPLES = 3000
MAX_SEQ_LEN = 1024


@pytest.fixture(scope="module")
def mix() -> tuple[list[int], list[int]]:
    lengths, media = bench.llava_like_lengths(SAMPLES, MAX_SEQ_LEN, seed=3)
    return lengths.tolist(), media.tolist()


def test_the_mix_follows_its_recipe(mix):
    lengths, media = mix
    assert len(lengths) == len(media) == SAMPLES
    assert min(lengths) >= 8 and max(lengths) <= 2 * MAX_SEQ_LEN
    assert set(media) <= {0, 1, 2, 3, 4} and 0.6 < media.count(1) / SAMPLES < 0.8
    again, _ = bench.llava_like_lengths(SAMPLES, MAX_SEQ_LEN, seed=3)
    assert again.tolist() == lengths


@pytest.mark.parametrize(("strategy", "spec"), [("bfd", {"buffer_size": SAMPLES}),
                                                ("greedy", {"buffer_size": 64, "max_open_packs": 8})])
def test_numbers_are_those_of_the_training_plan(mix, strategy, spec):
    lengths, media = mix
    result = bench.run(strategy, lengths, media, MAX_SEQ_LEN, 5, **spec)
    plan = bench.planning_dataset(strategy, lengths, media, MAX_SEQ_LEN, 5, **spec).plan(0)
    packs = list(plan.packs)
    placed = sorted(i for pack in packs for i in pack)
    assert placed == sorted(set(range(SAMPLES)) - set(plan.dropped))  # every admitted sample once
    assert all(sum(lengths[i] for i in pack) <= MAX_SEQ_LEN for pack in packs)
    assert set(plan.dropped) == {i for i, n in enumerate(lengths) if n > MAX_SEQ_LEN}
    admitted = sum(lengths[i] for i in placed)
    assert result["packs"] == len(packs) and result["dropped"] == len(plan.dropped)
    assert result["lower_bound"] == math.ceil(admitted / MAX_SEQ_LEN) <= result["packs"]
    assert result["ratio"] == result["packs"] / result["lower_bound"]
    assert result["fill"] == pytest.approx(admitted / (len(packs) * MAX_SEQ_LEN))
    # the epoch's shuffled record order: packs are not formed from the samples in index order
    assert packs != list(bench.planning_dataset(strategy, lengths, media, MAX_SEQ_LEN, 6, **spec).plan(0).packs)

