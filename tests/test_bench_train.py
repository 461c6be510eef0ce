"""tools/bench_train.py: what it computes, cheaply. Its packed modes plan exactly as a training run does, every mode
trains the same admitted samples once, the padded baselines follow their batching rules, the step it times is the
trainer's own (``TrainStep``), and the ratios and verdicts follow from the measured numbers.

Wall-clock values are never asserted (they depend on the machine and its load); only relations that hold whatever
the timings are. The printed tables are formatting over the returned dict and are not parsed here.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from mvp_engine.engine.plan_report import micro_batches, rank_rows
from mvp_engine.engine.run_data import build_run_dataset
from mvp_engine.engine.testing import load_recipe
from mvp_engine.engine.train_step import TrainStep
from tools import bench_train as bench

SAMPLES = 40
MICRO_BATCH = 4
LENGTHS = (512, 2048)
SEED = 0


def args_for(*extra: str):
    return bench.parse_args(["--samples", str(SAMPLES), "--micro-batch", str(MICRO_BATCH), "--seed", str(SEED),
                             "--lengths", *map(str, LENGTHS), *extra])


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The bench's modes at every L (no model is built: batching and planning only), with what they came from."""
    workdir = tmp_path_factory.mktemp("bench_train")
    args = args_for()
    recipe = load_recipe(args.recipe)
    cfg = bench.run_config(args, workdir, max(LENGTHS))
    specs = bench.resolve_run_specs(cfg, recipe.attention_backends)
    processor = recipe.build_processor(cfg.model)
    data = bench.read_data(specs, recipe, processor)
    per_length = {length: bench.build_modes(args, recipe, workdir, length, data, "sdpa_varlen") for length in LENGTHS}
    return args, recipe, workdir, processor, data, per_length


def test_every_mode_trains_the_admitted_samples_once(planned):
    *_, data, per_length = planned
    for length, (modes, admitted, _) in per_length.items():
        assert admitted == sorted(i for i, n in enumerate(data.lengths) if n <= length)
        bench.check_same_samples(modes, admitted)  # raises otherwise
        names = [mode.name for mode in modes]
        assert names == [*bench.BASELINES, "greedy/sdpa_varlen", "greedy/sdpa", "bfd/sdpa_varlen", "bfd/sdpa"]
    assert len(per_length[512][1]) < len(per_length[2048][1]) <= SAMPLES  # the demo has samples over 512 tokens


def test_packed_modes_are_the_plan_of_a_training_run(planned):
    """The packs and micro-batches of ``+packing=<strategy>`` at L with micro-batches of R: the dataset the trainer
    builds over the demo sources with the recipe's own encoder (not the bench's), planned as it plans."""
    args, recipe, workdir, processor, _, per_length = planned
    encoder = recipe.build_encoder(processor)
    for length, (modes, _, rows) in per_length.items():
        for strategy in bench.STRATEGIES:
            specs = bench.run_specs(args, recipe, workdir, length, strategy, rows)
            training = build_run_dataset(specs, encoder, None)
            expected = micro_batches(rank_rows(training, 0, 0), rows, drop_last=False)
            for mode in modes:
                if mode.name.startswith(f"{strategy}/"):
                    assert mode.batches == expected, mode.name
                    assert all(len(batch) <= rows for batch in mode.batches)


def test_padded_baselines_follow_their_batching_rules(planned):
    *_, data, per_length = planned
    for length, (modes, admitted, rows) in per_length.items():
        by_name = {mode.name: mode for mode in modes}
        lengths = [data.lengths[i] for i in admitted]
        flat = {name: [row[0] for batch in by_name[name].batches for row in batch] for name in bench.BASELINES}
        order = torch.randperm(len(admitted), generator=torch.Generator().manual_seed(SEED)).tolist()
        assert flat[bench.RANDOM] == [admitted[j] for j in order]
        grouped = get_length_grouped_indices(lengths, MICRO_BATCH, mega_batch_mult=50,
                                             generator=torch.Generator().manual_seed(SEED))
        assert flat[bench.GROUPED] == [admitted[j] for j in grouped]
        random = [[admitted.index(row[0]) for row in batch] for batch in by_name[bench.RANDOM].batches]
        assert rows == bench.budget_rows(random, lengths, length)
        assert by_name[bench.BUDGET_VARLEN].batches == by_name[bench.BUDGET].batches
        assert all(len(row) == 1 for name in bench.BASELINES for batch in by_name[name].batches for row in batch)


def test_token_budget_batches_respect_the_budget_and_are_length_sorted():
    lengths = [int(n) for n in torch.randint(8, 600, (200,), generator=torch.Generator().manual_seed(1))]
    budget = 1024
    batches = bench.token_budget_batches(lengths, budget, SEED)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert all(len(batch) * max(lengths[i] for i in batch) <= budget for batch in batches)
    laid_out = sorted(batches, key=lambda batch: -lengths[batch[0]])  # longest batch first: lengths never increase
    flat = [lengths[i] for batch in laid_out for i in batch]
    assert flat == sorted(flat, reverse=True)
    for batch, following in zip(laid_out, laid_out[1:]):
        assert (len(batch) + 1) * lengths[batch[0]] > budget  # each batch as full as allowed
        assert lengths[following[0]] <= lengths[batch[-1]]


def test_ratios_and_targets_follow_from_the_rates():
    results = [{"mode": name, "tokens_per_s": rate} for name, rate in
               [(bench.RANDOM, 100.0), (bench.GROUPED, 120.0), (bench.BUDGET, 150.0), (bench.BUDGET_VARLEN, 160.0),
                ("bfd/sdpa_varlen", 170.0)]]
    ratios = bench.ratios(results)
    assert list(ratios) == ["bfd/sdpa_varlen"]
    assert ratios["bfd/sdpa_varlen"] == pytest.approx({bench.RANDOM: 1.7, bench.GROUPED: 170 / 120,
                                                       bench.BUDGET: 170 / 150, bench.BUDGET_VARLEN: 170 / 160})
    for length, expected in ((512, {bench.BUDGET: True, bench.BUDGET_VARLEN: True}),
                             (2048, {bench.BUDGET: True, bench.GROUPED: False, bench.BUDGET_VARLEN: True})):
        found = bench.targets({"length": length, "ratios": ratios}, "bfd/sdpa_varlen")
        assert {t["baseline"]: t["ok"] for t in found} == expected
        assert all(t["value"] == ratios["bfd/sdpa_varlen"][t["baseline"]] for t in found)


def test_a_tiny_run_times_the_trainers_step_on_the_same_data_in_every_mode(monkeypatch):
    calls = []
    step = TrainStep.__call__

    def counted(self, group, model, optimizer, scheduler):
        calls.append(len(group))
        return step(self, group, model, optimizer, scheduler)

    monkeypatch.setattr(TrainStep, "__call__", counted)
    with contextlib.redirect_stdout(io.StringIO()):
        result = bench.main(["--samples", "12", "--lengths", "256", "--repeats", "1", "--micro-batch", "4",
                             "--packed-backends", "sdpa_varlen", "--seed", str(SEED)])
    (measured,) = result["lengths"]
    results = measured["results"]
    assert len(calls) == sum(1 + r["steps"] for r in results) and set(calls) == {1}  # warm-up + epoch, one each
    assert len({(r["samples"], r["effective_tokens"]) for r in results}) == 1
    assert results[0]["samples"] == measured["admitted"]
    assert results[0]["effective_tokens"] == sum(measured["record_lengths"][i] for i in measured["admitted_records"])
    for r in results:
        assert r["tokens_per_s"] == pytest.approx(r["effective_tokens"] / r["seconds"], rel=1e-12)
        assert r["padding_ratio"] == pytest.approx(1 - r["effective_tokens"] / r["slots"], rel=1e-12)
        assert r["steps"] == len(r["batches"])
    assert result["target_mode"] == f"bfd/{result['default_backend']}"
    assert result["ok"] == all(t["ok"] for t in result["targets"])
