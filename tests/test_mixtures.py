"""Weighted mixtures (``data.sources`` entries with ``repeat``, ``name``, ``image_root``): the per-epoch draw is exact,
seeded and the same on every rank and after a resume; plans, ledgers and per-source tallies count every draw; bad
entries stop with one line naming them; a real run's per-source summary adds up to its totals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, RunState
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.plan_report import compute_step_estimate
from mvp_engine.engine.run_files import RunFiles
from mvp_engine.engine.trainer import Progress
from mvp_engine.kit.mllm.data import (
    MLLMDataKit,
    MLLMDataSpec,
    MLLMPackingSpec,
    MLLMSource,
    RecordLedger,
    SourceTally,
    TokenAccounting,
    epoch_draw,
)
from mvp_engine.kit.mllm.data.mixture import source_entries
from tests.fakes import FakeEncoder

SIZES = [5, 8, 4, 3, 10]
REPEATS = [2, 0.5, 2.5, 0, 2.3]


def draw(seed: int = 0, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
    sources = [MLLMSource(path=f"s{i}.jsonl", repeat=r, name=f"s{i}") for i, r in enumerate(REPEATS)]
    offsets = np.cumsum([0, *SIZES])
    return epoch_draw(sources, offsets, seed, epoch), offsets


def test_the_draw_takes_every_record_repeat_times_and_an_exact_seeded_fraction():
    indices, offsets = draw()
    counts = np.bincount(indices, minlength=offsets[-1])
    per_source = [counts[offsets[s]:offsets[s + 1]] for s in range(len(SIZES))]
    assert per_source[0].tolist() == [2] * 5  # repeat 2: every record twice
    assert sorted(per_source[1].tolist()) == [0] * 4 + [1] * 4  # 0.5 of 8: exactly 4, none twice
    assert per_source[2].sum() == 10 and set(per_source[2].tolist()) == {2, 3}  # 2.5 of 4: twice each + 2 more
    assert per_source[3].sum() == 0  # repeat 0: left out
    assert per_source[4].sum() == 23 and sorted(per_source[4].tolist()) == [2] * 7 + [3] * 3  # 2.3 x 10 = 23


def test_the_draw_is_fixed_by_seed_and_epoch_and_differs_across_epochs():
    assert np.array_equal(draw(0, 1)[0], draw(0, 1)[0])
    epochs = {tuple(draw(0, epoch)[0].tolist()) for epoch in range(4)}
    assert len(epochs) > 1  # the fractions are drawn afresh each epoch
    assert not np.array_equal(draw(0, 0)[0], draw(1, 0)[0])
    assert all(len(draw(seed, epoch)[0]) == 10 + 4 + 10 + 0 + 23 for seed in (0, 1) for epoch in (0, 3))


@pytest.mark.parametrize(("entries", "message"), [
    ([{"path": "a.jsonl", "weight": 2}], "data.sources[0]: unknown key 'weight' (allowed: path, repeat, name, "
                                         "image_root)"),
    (["b.jsonl", {"path": "a.jsonl", "repeat": -1}], "data.sources[1]: repeat=-1 is invalid: allowed a number >= 0"),
    ([{"path": "a.jsonl", "name": "m"}, {"path": "b.jsonl", "name": "m"}],
     "data.sources[1]: name 'm' is already used by data.sources[0]"),
    (["/d/a.jsonl", "/e/b.jsonl", "/d/./a.jsonl"], "data.sources[2]: /d/./a.jsonl is already data.sources[0]"),
    ([{"repeat": 2}], "data.sources[0]: 'path' is missing or empty"),
    ([{"path": "a.jsonl", "repeat": "lots"}], "data.sources[0]: repeat='lots' is invalid"),
])
def test_a_bad_entry_is_one_line_naming_it(entries, message):
    with pytest.raises(ValueError) as err:
        source_entries(entries)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(("paths", "names"), [
    (["/data/llava/train.jsonl", "/data/sharegpt4v/train.jsonl"], ["llava/train", "sharegpt4v/train"]),
    (["/d/mixed/instruct.json", "/d/mixed/instruct.jsonl"], ["instruct.json", "instruct.jsonl"]),
    (["/a/x/train.jsonl", "/b/x/train.jsonl", "/c/val.jsonl"], ["a/x/train", "b/x/train", "val"]),
    ([{"path": "/p/b.jsonl", "name": "a"}, "/q/a.jsonl"], ["a", "q/a"]),  # a name the user gave is never taken
], ids=["folders", "suffixes", "deeper", "given"])
def test_default_names_are_the_shortest_paths_that_tell_sources_apart(paths, names):
    assert [source.name for source in source_entries(paths)] == names


def test_hydra_entries_and_their_errors_through_the_run_config(tmp_path):
    data = kit.write_mixed_jsonl(tmp_path, num_records=3)
    cfg = kit.compose_config("llava", [f"data.sources=[{{path:{data},repeat:2,name:a}},{data}]"])
    entries = resolve_run_specs(cfg, ("sdpa", "eager")).data.source_entries()
    assert entries == [MLLMSource(str(data), 2.0, "a"), MLLMSource(str(data), 1.0, "mixed")]
    for override, line in [(f"data.sources=[{{path:{data},repeat:-0.5}}]", "data.sources[0]: repeat=-0.5 is invalid"),
                           (f"data.sources=[{{path:{data},ratio:2}}]", "data.sources[0]: unknown key 'ratio'"),
                           (f"data.sources=[{data},{data}]", f"data.sources[1]: {data} is already data.sources[0]"),
                           ("data.sources=[{path:/nonexistent.jsonl,repeat:2}]",
                            "data.sources: /nonexistent.jsonl: data source not found")]:
        with pytest.raises(ConfigError) as err:
            resolve_run_specs(kit.compose_config("llava", [override]), ("sdpa", "eager"))
        assert str(err.value).startswith(line) and "\n" not in str(err.value)


def write_fake_source(path: Path, start: int, lengths: list[int], faults: dict[int, str] | None = None) -> Path:
    """FakeEncoder records (``"<length> 0 [fault]"``), ids from ``start``; ``faults``: position -> measure/decode."""
    faults = faults or {}
    lines = [{"id": f"r{start + i}", "messages": [{"role": "user", "content": f"{n} 0 {faults.get(i, '')}".strip()},
                                                   {"role": "assistant", "content": "ok"}]}
             for i, n in enumerate(lengths)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def mixture(tmp_path) -> MLLMDataSpec:
    """Three sources: 8 records twice, 8 records at half (one measure fault, one decode fault, one overlong), and 4
    records read once from their own image root."""
    a = write_fake_source(tmp_path / "a.jsonl", 0, [10 + i for i in range(8)])
    b = write_fake_source(tmp_path / "b.jsonl", 100, [12, 9, 300, 14, 8, 11, 13, 7], {1: "measure", 4: "decode"})
    c = write_fake_source(tmp_path / "c.jsonl", 200, [20, 21, 22, 23])
    sources = [{"path": str(a), "repeat": 2}, {"path": str(b), "repeat": 0.5, "name": "half"},
               {"path": str(c), "image_root": str(tmp_path)}]
    return MLLMDataSpec(sources=sources, packing=MLLMPackingSpec(max_seq_len=64, strategy="bfd", buffer_size=4096),
                        cache_dir=str(tmp_path / "cache"), measure_workers=1, max_bad_fraction=0.5)


def test_plans_and_ledgers_count_every_draw_per_source(mixture):
    dataset = MLLMDataKit.build_dataset(mixture, FakeEncoder(), micro_batch_size=2)
    assert [s.name for s in dataset.sources] == ["a", "half", "c"]
    for epoch in range(3):
        drawn = Counter(dataset.draw(epoch).tolist())
        planned = Counter(i for pack in dataset.plan(epoch).packs for i in pack)
        usable = dataset.admission.admitted_mask
        assert planned == Counter({i: n for i, n in drawn.items() if usable[i]})  # duplicates planned as drawn
        assert all(drawn[i] == 2 for i in range(8)) and all(drawn[i] == 1 for i in range(16, 20))
        assert sum(drawn[i] for i in range(8, 16)) == 4 and max(drawn[i] for i in range(8, 16)) == 1
        tallies = dataset.epoch_sources(2, epoch)
        assert [t.records for t in tallies] == [16, 4, 4]
        half = tallies[1]
        assert half.dropped == Counter({"overlong": 1} if drawn[10] else {})
        assert half.bad == Counter({"unreadable_image": 1} if drawn[9] else {})
        ledger = dataset.epoch_ledger(2, epoch)
        assert ledger.records_read == 24
        assert ledger.dropped == sum((t.dropped for t in tallies), Counter())
        assert ledger.bad == sum((t.bad for t in tallies), Counter())
    # the epochs' halves differ, their sizes do not: the step estimate plans each epoch as the run trains it
    assert len({tuple(sorted(set(dataset.draw(e).tolist()) & set(range(8, 16)))) for e in range(6)}) > 1
    counts = [len(dataset.plan(epoch).packs) for epoch in range(3)]
    assert dataset.estimate_total_steps(3, 2) == sum(-(-n // 2) for n in counts)


def test_the_dropped_records_file_has_a_line_per_dropped_draw_naming_its_source(tmp_path):
    """A record a ``repeat: 2`` source draws twice and the plan drops is two lines of ``dropped_records.jsonl``
    (``draw`` 0 and 1), each naming its source; per source and reason the lines are the tallies' drops, the draws
    ``drop_last`` leaves out included."""
    a = write_fake_source(tmp_path / "a.jsonl", 0, [40, 300, 30, 20])
    b = write_fake_source(tmp_path / "b.jsonl", 100, [300, 50, 10])
    spec = MLLMDataSpec(sources=[{"path": str(a), "repeat": 2}, {"path": str(b), "name": "once"}],
                        packing=MLLMPackingSpec(max_seq_len=64, strategy="bfd", buffer_size=4096),
                        cache_dir=str(tmp_path / "cache"), measure_workers=1)
    dataset = MLLMDataKit.build_dataset(spec, FakeEncoder(), drop_last=True, micro_batch_size=3)
    files = RunFiles(tmp_path / "run")
    files.make()
    files.list_dropped_records(dataset, 3, 0)
    lines = [json.loads(line) for line in files.dropped_records.read_text().splitlines()]
    assert [(line["source"], line["record_id"], line["draw"]) for line in lines if line["reason"] == "overlong"] == \
        [("a", "r1", 0), ("a", "r1", 1), ("once", "r100", 0)]
    tallies = dataset.epoch_sources(3, 0)
    assert tallies[0].dropped["drop_last"] > 0
    assert Counter((line["source"], line["reason"]) for line in lines) == \
        Counter({(s.name, reason): n for s, t in zip(dataset.sources, tallies) for reason, n in t.dropped.items()})
    assert len({(line["origin"], line["draw"]) for line in lines}) == len(lines)


def test_served_packs_count_samples_and_tokens_per_source(mixture):
    dataset = MLLMDataKit.build_dataset(mixture, FakeEncoder())
    epoch = next(e for e in range(20) if 12 in dataset.draw(e))  # an epoch that draws the record failing to decode
    dataset.set_epoch(epoch)
    plan = dataset.plan(epoch)
    rows = [dataset.encode_pack(pack) for pack in plan.packs]
    counts = sum(row["source_counts"] for row in rows)
    lengths, drawn = dataset.admission.lengths, dataset.draw(epoch)
    decoded_bad = [bad for row in rows for bad in row["bad_records"]]
    assert all(bad["source"] == 1 and bad["reason"] == "corrupt_image" for bad in decoded_bad)
    for s in range(3):
        trained = [i for pack in plan.packs for i in pack if dataset.source_of(np.array([i]))[0] == s
                   and i != 12]  # record 12 (b's fifth) fails to decode
        assert counts[s, 0] == len(trained)
        assert counts[s, 1] == sum(int(lengths[i]) for i in trained)
        # FakeEncoder supervises odd positions; each segment's first label is ignored anyway (position 0 is even)
        assert counts[s, 2] == sum(int(lengths[i]) // 2 for i in trained)
    assert len(decoded_bad) == int((drawn == 12).sum()) == 1


def test_every_rank_and_a_resumed_dataset_draw_the_same(mixture):
    ranks = [MLLMDataKit.build_dataset(mixture, FakeEncoder(), rank=r, world_size=2) for r in range(2)]
    fresh = MLLMDataKit.build_dataset(mixture, FakeEncoder())
    for epoch in (0, 1):
        assert np.array_equal(ranks[0].draw(epoch), ranks[1].draw(epoch))
        assert np.array_equal(ranks[0].draw(epoch), fresh.draw(epoch))
        served = sorted(i for r in ranks for pack in r.rank_packs(epoch) for i in pack)
        assert served == sorted(i for pack in fresh.plan(epoch).packs for i in pack)


def test_a_source_image_root_wins_over_the_data_root(tmp_path):
    (tmp_path / "own").mkdir()
    name = "pic.png"
    kit.write_image(tmp_path / "own" / name, 32, 32, 0)
    record = {"id": "x", "image": name, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                          {"from": "gpt", "value": "A picture."}]}
    source = tmp_path / "elsewhere" / "rel.jsonl"
    source.parent.mkdir()
    source.write_text(json.dumps(record) + "\n")
    spec = MLLMDataSpec(sources=[{"path": str(source), "image_root": str(tmp_path / "own")}], image_root="/nowhere",
                        cache_dir=str(tmp_path / "cache"))
    read = MLLMDataKit.open_store(spec)[0]
    assert read.image_paths == [str(tmp_path / "own" / name)]
    assert MLLMDataKit.read_records(spec)[0].image_paths == read.image_paths


def test_a_checkpoint_from_before_per_source_tallies_resumes_counting():
    progress = Progress.from_state(RunState(step=3, epoch_steps_done=3, epochs=[RecordLedger(0, 8).to_dict()]))
    progress.record_step(1.0, TokenAccounting(samples=2, effective=10, supervised=5), 8, {"a": [2, 10, 5]})
    assert progress.state.sources == {"a": SourceTally(0, 2, 10, 5).to_dict()}


def mixed_sources(directory: Path) -> list[Path]:
    """Three real sources for a recipe run: ``a`` (8 records), ``b`` (6) and ``c`` (2, one bad line, one overlong)."""
    a = kit.write_mixed_jsonl(directory / "a", num_records=8)
    b = kit.write_mixed_jsonl(directory / "b", num_records=6)
    c = kit.write_mixed_jsonl(directory / "c", num_records=2)
    long = {"id": "long", "conversations": [{"from": "human", "value": "Talk."},
                                            {"from": "gpt", "value": " ".join(f"w{i}" for i in range(400))}]}
    with c.open("a") as handle:
        handle.write("{not json\n" + json.dumps(long) + "\n")
    return [a, b, c]


def run_overrides(sources: list[Path]) -> list[str]:
    a, b, c = sources
    return ["+packing=greedy", f"data.sources=[{{path:{a},repeat:2,name:a}},{{path:{b},repeat:0.5,name:b}},"
            f"{{path:{c},name:c}}]", "data.max_seq_len=160", "data.max_bad_fraction=0.5", "train.epochs=2",
            "train.micro_batch_size=2", "train.log_every=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[Path], Path]:
    """The three sources and an uninterrupted 1-process run over them, checkpointed after every step."""
    data = mixed_sources(tmp_path_factory.mktemp("mixture_data"))
    run = tmp_path_factory.mktemp("mixture_run")
    kit.train("llava", run, [*run_overrides(data), "train.save_every_steps=1", "train.keep_last=100"])
    return data, run


def test_a_run_reports_each_source_and_the_sources_add_up_to_the_totals(reference):
    data, run = reference
    summary, metrics = kit.read_summary(run), kit.read_metrics(run)
    sources, totals = summary["sources"], summary["totals"]
    assert summary["estimated_steps"] == summary["actual_steps"] == len(metrics)
    assert compute_step_estimate(kit.compose_config("llava", run_overrides(data)))["total_optimizer_steps"] == \
        len(metrics)  # tools/estimate_steps.py's number
    # per epoch: every record of a twice, floor(0.5 x 6) of b, c's 4 rows once
    assert {name: s["records"] for name, s in sources.items()} == {"a": 2 * 8 * 2, "b": 3 * 2, "c": 4 * 2}
    assert sources["c"]["bad"] == {"invalid_json": 2} and sources["c"]["dropped"] == {"overlong": 2}
    assert all(s["dropped"] == s["bad"] == {} for name, s in sources.items() if name != "c")
    for name, total in [("samples", "samples"), ("effective_tokens", "effective"), ("supervised_tokens", "supervised")]:
        assert sum(s[name] for s in sources.values()) == totals[total]
        assert all(s[name] > 0 for s in sources.values())
    assert sum(s["records"] for s in sources.values()) == sum(e["records_read"] for e in summary["epochs"])
    assert sum((Counter(s["dropped"]) for s in sources.values()), Counter()) == Counter(totals["dropped"])
    assert sum((Counter(s["bad"]) for s in sources.values()), Counter()) == \
        sum((Counter(e["bad"]) for e in summary["epochs"]), Counter())
    assert all(e["reconciles"] for e in summary["epochs"])
    for s in sources.values():
        assert s["records"] == s["samples"] + sum(s["dropped"].values()) + sum(s["bad"].values())
    logged = [m for m in metrics if "source_token_shares" in m]
    assert [m["step"] for m in logged] == [m["step"] for m in metrics if m["step"] % 2 == 0] and logged
    assert all(sum(m["source_token_shares"].values()) == pytest.approx(1.0) for m in logged)
    if metrics[-1] is logged[-1]:
        assert logged[-1]["source_token_shares"] == pytest.approx(
            {name: s["effective_tokens"] / totals["effective"] for name, s in sources.items()})


def test_a_resumed_run_draws_and_counts_what_the_uninterrupted_one_did(reference, tmp_path):
    data, run = reference
    metrics = kit.read_metrics(run)
    step = len(metrics) // 2 + 1  # mid-run
    kit.train("llava", tmp_path, [*run_overrides(data), f"train.resume_from={run / CHECKPOINTS / f'step_{step:08d}'}"])
    assert kit.read_metrics(tmp_path) == metrics[step:]
    assert kit.read_summary(tmp_path)["sources"] == kit.read_summary(run)["sources"]


@pytest.mark.launch
def test_two_ranks_draw_and_train_what_one_rank_does(reference, tmp_path):
    """2 gloo ranks x micro-batch 1 split the same global batch as 1 rank x micro-batch 2: the same steps, the same
    per-source numbers (a rank drawing another fraction of b would train other records)."""
    data, run = reference
    kit.train("llava", tmp_path, [*run_overrides(data), "train.micro_batch_size=1"], nproc=2)
    one, two = kit.read_summary(run), kit.read_summary(tmp_path)
    assert two["actual_steps"] == two["estimated_steps"] == one["actual_steps"]
    assert two["sources"] == one["sources"]
