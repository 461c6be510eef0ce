"""``packing.balance``: packs grouped into steps by cost and spread over ranks, without changing what is trained.

Why: balancing reorders the epoch's plan, and everything else (equal pack counts per rank, the step estimate,
resume, determinism across ranks and restarts, drop_last) reads that order. Checked: the order is a permutation that
keeps every count, the packs drop_last leaves out and the step count; ``balance: none`` is the planner's order,
byte for byte; the stored and the streamed plan give the same order and resume mid-epoch; every rank computes the
same plan; on a mix with uneven costs the per-step imbalance falls; a missing cost profile and a bad value fail
with one line naming ``packing.balance``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.testing import compose_config
from mvp_engine.kit.mllm.data import (
    CostProfile,
    MLLMDataKit,
    MLLMDataSpec,
    MLLMPackingSpec,
    Rate,
    StepLayout,
    balanced_order,
    imbalance_summary,
)
from mvp_engine.kit.mllm.data.balance import balance_rng, step_rank_costs
from tests.fakes import FakeEncoder, fake_record
from tools import bench_balance

# tokens cost 1, attention pairs a little, vision a lot: media-heavy packs are expensive
PROFILE = CostProfile(lm_token=Rate(2, 4), lm_pair=Rate(0, 1), vision_position=Rate(40, 80), vision_pair=Rate(1, 2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 90), world_size=st.integers(1, 5), per_rank=st.integers(1, 4), window=st.integers(1, 4),
       dropped=st.integers(0, 7), seed=st.integers(0, 3))
def test_balanced_order_permutes_within_served_packs_and_evens_each_full_step(n, world_size, per_rank, window,
                                                                               dropped, seed):
    rng = np.random.default_rng(seed)
    cost = rng.lognormal(0, 1, size=n)
    packs = [[k] for k in range(n)]
    served = max(0, n - dropped)
    layout = StepLayout(world_size, per_rank, served)

    def costs(chunk):
        return cost[[p[0] for p in chunk]]

    order = list(balanced_order(packs, layout, costs, window, balance_rng(seed, 0)))
    again = list(balanced_order(packs, layout, costs, window, balance_rng(seed, 0)))
    assert order == again, "not deterministic"
    assert sorted(order) == packs, "a pack was lost or repeated"
    assert order[served:] == packs[served:], "packs drop_last leaves out must stay where they are"
    assert sorted(order[layout.full_end:served]) == packs[layout.full_end:served], "the tail left its step"
    full, _ = step_rank_costs(costs(order), layout)
    window_packs = window * layout.step_packs
    for start in range(0, layout.full_end, window_packs):  # each window holds exactly its own packs
        assert sorted(order[start:start + window_packs]) == packs[start:start + window_packs]
    for row, step in zip(full, range(len(full))):
        step_costs = costs(order[step * layout.step_packs:(step + 1) * layout.step_packs])
        # LPT with equal counts: no rank exceeds the mean by more than the step's largest pack
        assert row.max() <= row.mean() + step_costs.max() + 1e-9


def test_balance_lowers_the_imbalance_of_an_uneven_mix():
    rng = np.random.default_rng(0)
    cost = np.where(rng.random(4000) < 0.3, rng.uniform(5, 10, 4000), rng.uniform(0.5, 1.5, 4000))
    packs = [[k] for k in range(len(cost))]

    def costs(chunk):
        return cost[[p[0] for p in chunk]]

    for per_rank in (1, 3):
        layout = StepLayout(8, per_rank, len(packs))
        order = list(balanced_order(packs, layout, costs, 64, balance_rng(0, 0)))
        before, after = imbalance_summary(costs(packs), layout), imbalance_summary(costs(order), layout)
        assert before["mean"] > 1.3 and after["mean"] <= 1.05 and after["p95"] <= 1.15, (before, after)


def records(n: int = 150) -> list:
    """Text samples of varied lengths next to media-heavy ones: packs of very different costs."""
    return [fake_record(i, 3 + (i * 7) % 20, media=(3 if i % 4 == 0 else 0)) for i in range(n)]


def dataset(strategy: str, balance: str, rank: int = 0, world_size: int = 3, micro_batch_size: int = 2,
            accumulation: int = 1, drop_last: bool = False, buffer_size: int = 1000, profile=PROFILE):
    packing = MLLMPackingSpec(max_seq_len=32, strategy=strategy, buffer_size=buffer_size, balance=balance,
                              balance_window=2, seed=5)
    return MLLMDataKit.build_dataset(MLLMDataSpec(packing=packing, seed=5), FakeEncoder(), rank=rank,
                                     world_size=world_size, drop_last=drop_last, records=records(),
                                     micro_batch_size=micro_batch_size, gradient_accumulation_steps=accumulation,
                                     cost_profile=profile)


@pytest.mark.parametrize("strategy", ["bfd", "greedy"])
def test_balance_none_is_the_planners_order(strategy):
    ds = dataset(strategy, "none")
    assert list(ds.plan(0).packs) == list(ds._groups(0))


@pytest.mark.parametrize("strategy,drop_last,accumulation", [("bfd", False, 1), ("greedy", True, 2),
                                                             ("bfd", True, 3)])
def test_balance_keeps_counts_steps_and_drops(strategy, drop_last, accumulation):
    plain = dataset(strategy, "none", drop_last=drop_last, accumulation=accumulation)
    balanced = dataset(strategy, "compute", drop_last=drop_last, accumulation=accumulation)
    before, after = list(plain.plan(0).packs), list(balanced.plan(0).packs)
    assert before != after and Counter(map(tuple, before)) == Counter(map(tuple, after))
    assert len(balanced.rank_packs()) == len(plain.rank_packs())
    assert balanced.estimate_total_steps(2, 2, accumulation) == plain.estimate_total_steps(2, 2, accumulation)
    assert balanced.left_out_by_drop_last(2) == plain.left_out_by_drop_last(2)
    layout = balanced.step_layout(len(after))
    costs_before, costs_after = balanced.pack_costs(before), balanced.pack_costs(after)
    assert imbalance_summary(costs_after, layout)["mean"] < imbalance_summary(costs_before, layout)["mean"]


def test_stored_and_streamed_plans_balance_alike_and_every_rank_agrees():
    stored = dataset("bfd", "compute")  # one buffer over the data set: a stored plan
    streamed = dataset("bfd", "compute", buffer_size=149)  # windowed bfd: replayed, balanced window by window
    assert type(stored).__name__ == "MLLMPackedDataset" and type(streamed).__name__ == "MLLMStreamingPackedDataset"
    assert list(stored.plan(0).packs) == list(stored.plan(0).packs)
    ranks = [dataset("bfd", "compute", rank=r) for r in range(3)]
    served = [list(ds.rank_packs()) for ds in ranks]
    plan = list(stored.plan(0).packs)
    assert [p for k in range(len(served[0])) for r in range(3) if (p := served[r][k])] == plan
    replayed = list(streamed.plan(0).packs)
    assert replayed == list(streamed.plan(0).packs), "a replayed balanced plan must replay the same"


@pytest.mark.parametrize("strategy", ["bfd", "greedy"])
def test_a_balanced_epoch_resumes_mid_epoch(strategy):
    full = [row["sample_ids"] for row in iterate(dataset(strategy, "compute"))]
    resumed = dataset(strategy, "compute").starting_at(5)
    assert [row["sample_ids"] for row in iterate(resumed)] == full[5:]


def iterate(ds):
    return list(ds) if hasattr(ds, "state_dict") else [ds[k] for k in range(len(ds))]


def test_balance_needs_a_cost_profile_and_a_valid_value():
    with pytest.raises(ValueError, match="packing.balance=compute needs the model's cost profile"):
        dataset("bfd", "compute", profile=None).plan(0)
    assert len(dataset("bfd", "none", profile=None).plan(0).packs) > 0
    with pytest.raises(ValueError, match=r"packing.balance='fast' is invalid: allowed one of \['none', 'compute'\]"):
        MLLMPackingSpec(balance="fast")
    with pytest.raises(ValueError, match="packing.balance_window=0 is invalid"):
        MLLMPackingSpec(balance_window=0)
    with pytest.raises(ConfigError, match="packing.balance"):
        resolve_run_specs(compose_config("qwen2_vl", ["+packing=bfd", "packing.balance=sometimes"]), ("eager",))


def test_bench_balance_meets_the_targets_at_8_ranks():
    """``tools/bench_balance.py``'s simulation (small): on both mixes balance compute plans the same packs and steps
    as none, evens them within mean 1.05 / p95 1.15 where none does not, and says OK."""
    rows = bench_balance.simulate_rows(bench_balance.parse_args(["--samples", "3000", "--per-rank", "1"]))
    assert [(r["mix"], r["balance"]) for r in rows] == [("llava", "none"), ("llava", "compute"), ("video", "none"),
                                                        ("video", "compute")]
    for none, compute in zip(rows[::2], rows[1::2]):
        assert none["packs"] == compute["packs"] and none["full_steps"] == compute["full_steps"] > 10
        assert compute["world_size"] == bench_balance.RANKS and compute["packs_per_rank_per_step"] == 1
        assert compute["mean"] <= bench_balance.TARGET_MEAN and compute["p95"] <= bench_balance.TARGET_P95
        assert 1 <= compute["mean"] < none["mean"] and compute["p95"] < none["p95"]
        assert (none["verdict"], compute["verdict"]) == ("-", "OK")


@pytest.mark.parametrize("mean,p95,expected", [(1.05, 1.15, "OK"), (1.06, 1.0, "MISS"), (1.0, 1.16, "MISS")])
def test_bench_balance_verdict_is_the_targets(mean, p95, expected):
    assert bench_balance.verdict({"mean": mean, "p95": p95}, "compute") == expected
    assert bench_balance.verdict({"mean": mean, "p95": p95}, "none") == "-"


def step_packs(strategy: str, balance: str, world_size: int, micro_batch_size: int, accumulation: int) -> list:
    """Per optimizer step, the packs every rank trains in it (all-padding rows left out), as a sorted list."""
    ranks = [list(dataset(strategy, balance, rank=r, world_size=world_size, micro_batch_size=micro_batch_size,
                          accumulation=accumulation).rank_packs()) for r in range(world_size)]
    per_step = micro_batch_size * accumulation
    return [sorted(tuple(p) for served in ranks for p in served[s * per_step:(s + 1) * per_step] if p)
            for s in range(-(-len(ranks[0]) // per_step))]


@pytest.mark.parametrize("strategy,balance", [("bfd", "none"), ("greedy", "none"), ("bfd", "compute"),
                                              ("greedy", "compute")])
def test_every_split_of_one_global_batch_trains_the_same_packs_in_each_step(strategy, balance):
    """What elastic resume rests on: packs go to steps before ranks, so a step count is one position under any
    world size x micro-batch x accumulation of the same product, round-robin or compute-balanced, short last step
    included (the plan's pack count is not a multiple of 6)."""
    splits = [(3, 2, 1), (1, 2, 3), (6, 1, 1), (1, 1, 6), (2, 1, 3)]
    steps = [step_packs(strategy, balance, *split) for split in splits]
    assert len(dataset(strategy, balance).plan(0).packs) % 6, "the epoch must end on a short step"
    assert all(s == steps[0] for s in steps[1:])
