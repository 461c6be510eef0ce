"""The stream mode (``data.streaming=true``, kit ``stream.py``): data read in order, packed from a seeded buffer,
resumed from cursors and buffered keys on any split of the same global batch.

In-process, at the dataset (fake encoder, no model): the packs of 2 ranks x accumulation 1, interleaved, are the
packs of 1 rank x accumulation 2; a state handed out after a step, through JSON, starts a dataset on the other
world size at exactly the packs the uninterrupted one trains next; sources are a ``datasets`` IterableDataset over
a local JSONL file (``load_dataset(..., streaming=True)``) and a plain list, mixed, read past their end (a second
pass), in the main process and in DataLoader workers alike; and a list of WebDataset tar shards, read shard by
shard; bad records are named by origin (``source#row``, ``shard.tar#key``), once per read. The
refusals: no ``train.max_steps``, a packing that cannot pack a stream, planning a stream ahead (the reports).

Real trainings (llava, slow): one uninterrupted reference (1 rank x accumulation 2, a checkpoint after every step)
that every check shares: it trains exactly ``train.max_steps`` steps with bad records counted and named; a
SIGKILLed run resumed with ``train.resume_from=auto`` logs exactly its metrics; a 2-rank run trains the same samples
(loss within 1e-5) and its mid-run checkpoint resumes on 1 rank x accumulation 2 with the reference's next steps.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, load_run_state
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.run import planning_dataset
from mvp_engine.kit.mllm.data import (
    IterableStream,
    MLLMCollator,
    MLLMDataSpec,
    MLLMPackingSpec,
    MLLMRecordError,
    MLLMStreamDataset,
)
from tests.fakes import FakeEncoder
from tests.test_elastic import assert_same_training
from tests.test_shard_sources import write_shards

RECIPE = "llava"
STEPS = 10


# --- the dataset, in-process ------------------------------------------------------------------------------------


def raw_records(count: int, seed: int) -> list[dict]:
    """Fake-encoder records (``"<length> <media>"``) of varied lengths; every 7th one is not a record at all."""
    lengths = np.random.default_rng(seed).integers(4, 40, count).tolist()
    return [{"id": f"r{i}", "bogus": True} if i % 7 == 3 else
            {"id": f"r{i}", "messages": [{"role": "user", "content": f"{n} 0"}, {"role": "assistant", "content": "ok"}]}
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def hf_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "records.jsonl"
    path.write_text("".join(json.dumps(raw) + "\n" for raw in raw_records(23, seed=1)))
    return path


def stream_spec(**fields) -> MLLMDataSpec:
    return MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=64, buffer_size=6, max_open_packs=3, seed=5), **fields)


def stream_dataset(hf_jsonl: Path, world_size: int, rank: int, accumulation: int, state: dict | None = None):
    """A ``datasets`` IterableDataset over a JSONL file and a plain list, mixed, 12 steps."""
    import datasets

    hf = datasets.load_dataset("json", data_files=str(hf_jsonl), split="train", streaming=True)
    streams = [IterableStream("hf", hf, str(hf_jsonl.parent)), IterableStream("list", raw_records(13, seed=2), "/")]
    dataset = MLLMStreamDataset(stream_spec(), FakeEncoder(), 12, rank=rank, world_size=world_size,
                                gradient_accumulation_steps=accumulation, streams=streams)
    dataset.load_state_dict(state)
    return dataset


def resumed_across_world_sizes(make) -> tuple[list[dict], list[dict], list[dict]]:
    """``make(world_size, rank, accumulation, state)``'s packs: 1 rank x accumulation 2 (the reference), 2 ranks x 1
    interleaved (the same packs), and 1 rank x 2 from the 2-rank run's state after step 5 through JSON (the
    reference's packs from there); returns the reference, the 2-rank states and the resumed packs."""
    reference = list(make(1, 0, 2, None))  # 12 steps x 2 packs
    ranks = [list(make(2, rank, 1, None)) for rank in range(2)]
    assert [p["sample_ids"] for pair in zip(*ranks) for p in pair] == [p["sample_ids"] for p in reference]
    states = [pack["data_state"] for pack in ranks[0] if "data_state" in pack]
    assert len(states) == 12 and all(state["packs"] == 2 * (s + 1) for s, state in enumerate(states))
    state = json.loads(json.dumps(states[4]))  # after step 5: keys, cursors and RNG states, no record
    assert state["buffer"] and all(len(entry) == 4 for entry in state["buffer"])
    assert max(cursor[0] for cursor in states[-1]["cursors"]) >= 1, "a source was read past its end"
    resumed = list(make(1, 0, 2, state))
    assert [p["sample_ids"] for p in resumed] == [p["sample_ids"] for p in reference[10:]]
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, reference[10:]))
    assert [b["origin"] for p in resumed for b in p["bad_records"]] == \
        [b["origin"] for p in reference[10:] for b in p["bad_records"]]
    return reference, states, resumed


def bad_read(reference: list[dict], last: dict) -> list[str]:
    """Every bad record read, by origin: those served with packs, and those the last state still holds (found after
    the last pack made, or travelling with packs made but not served)."""
    held = [*last["pending_bad"], *(b for _, found in last["ready"] for b in found)]
    return sorted([b["origin"] for p in reference for b in p["bad_records"]] + [b["origin"] for b in held])


def test_a_stream_state_resumes_on_another_world_size_with_the_packs_the_run_trains_next(hf_jsonl):
    make = functools.partial(stream_dataset, hf_jsonl)
    reference, states, resumed = resumed_across_world_sizes(make)
    # in DataLoader workers too: each reads the whole stream (datasets' own __iter__ would split its files)
    loader = DataLoader(make(1, 0, 2, states[4]), batch_size=1, collate_fn=MLLMCollator(0), num_workers=2)
    assert [batch["sample_ids"][0] for batch in loader] == [p["sample_ids"] for p in resumed]
    read = dict(zip(("hf", "list"), states[-1]["read"]))
    # every read of a bad record is named once, by its source and row; a second pass reads them again
    assert bad_read(reference, states[-1]) == sorted(f"{name}#{i + 1}" for name, count in (("hf", 23), ("list", 13))
                                                     for n in range(read[name]) if (i := n % count) % 7 == 3)


def test_a_shard_list_streams_shard_by_shard_and_resumes_on_another_world_size(tmp_path):
    pattern = write_shards(tmp_path / "shards", raw_records(20, seed=3), shards=3)
    spec = stream_spec(sources=[pattern], streaming=True, cache_dir=str(tmp_path / "cache"))

    def make(world_size, rank, accumulation, state):
        dataset = MLLMStreamDataset(spec, FakeEncoder(), 12, rank=rank, world_size=world_size,
                                    gradient_accumulation_steps=accumulation)
        dataset.load_state_dict(state)
        return dataset

    reference, states, _ = resumed_across_world_sizes(make)
    assert [cursor[1] for cursor in states[0]["cursors"]] != [cursor[1] for cursor in states[-1]["cursors"]]
    passes, unit, row = states[-1]["cursors"][0]  # records read: whole passes of 20, then the shards before the cursor
    read = passes * 20 + 7 * unit + row
    assert read == states[-1]["read"][0]
    # a bad member is named by its shard and key, once per read
    shards = tmp_path / "shards"
    assert bad_read(reference, states[-1]) == sorted(f"{shards}/shard-{i // 7}.tar#{i:06d}" for n in range(read)
                                                     if (i := n % 20) % 7 == 3)


@pytest.mark.parametrize("overrides,line", [
    ((), "config error: train.max_steps is required with data.streaming=true"),
    (("train.max_steps=3", "+packing=bfd"), "config error: data.streaming=true packs greedily from its shuffle "
                                            "buffer: use +packing=greedy"),
])
def test_a_stream_mode_run_without_max_steps_or_greedy_packing_is_refused_in_one_line(tmp_path, overrides, line):
    data = kit.shared_mixed_jsonl()
    result = kit.train(RECIPE, tmp_path, [f"data.sources=[{data}]", "data.streaming=true", *overrides], check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr[-3000:]


def test_planning_a_stream_is_refused_in_one_line():
    """The reports and step estimates plan through planning_dataset: a stream has nothing to plan ahead."""
    cfg = kit.compose_config(RECIPE, ["+packing=greedy", "data.streaming=true", "train.max_steps=3",
                                      f"data.sources=[{kit.shared_mixed_jsonl()}]"])
    with pytest.raises(ConfigError, match=r"^data.streaming=true: a stream is read in order, not indexed, so nothing "
                                          r"plans it ahead \(no step estimate"):
        planning_dataset(cfg, kit.load_recipe(RECIPE))


def test_a_source_with_no_record_or_no_admissible_record_is_refused_instead_of_read_without_end(tmp_path):
    """A stream starts a source again at its end: one with nothing to pack would spin in a loader worker forever."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(MLLMRecordError, match=r"^empty: no record to stream"):
        MLLMStreamDataset(stream_spec(sources=[str(empty)]), FakeEncoder(), 3)
    bad = IterableStream("bad", [{"id": f"b{i}", "bogus": True} for i in range(5)], "/")
    overlong = IterableStream("long", [{"id": "l", "messages": [{"role": "user", "content": "90 0"},
                                                                {"role": "assistant", "content": "ok"}]}], "/")
    for stream in (bad, overlong):
        dataset = MLLMStreamDataset(stream_spec(), FakeEncoder(), 3, streams=[stream])
        with pytest.raises(MLLMRecordError, match=rf"^{stream.name}: a whole pass of the stream admitted no record"):
            next(iter(dataset))


# --- real trainings ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """25 mixed records, then an invalid JSON line and a record naming a missing image."""
    path = kit.write_mixed_jsonl(tmp_path_factory.mktemp("stream_data"), num_records=25)
    with path.open("a") as handle:
        handle.write('{"id": "cut", "conversations": [\n')
        handle.write(json.dumps({"id": "lost", "image": "absent.png",
                                 "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                   {"from": "gpt", "value": "Nothing."}]}) + "\n")
    return path


def common(data: Path, accumulation: int) -> list[str]:
    return ["+packing=greedy", "packing.buffer_size=4", "packing.max_open_packs=2", "data.streaming=true",
            f"data.sources=[{data}]", "data.max_seq_len=160", "data.max_bad_fraction=0.2", f"train.max_steps={STEPS}",
            "train.micro_batch_size=1", f"train.gradient_accumulation_steps={accumulation}",
            "train.learning_rate=5e-3", "train.warmup_ratio=0.2"]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The uninterrupted run every check compares with: 1 rank x accumulation 2, a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("stream_reference")
    kit.train(RECIPE, run_dir, [*common(data, 2), "train.save_every_steps=1", "train.keep_last=100"])
    return run_dir


@pytest.mark.slow
def test_a_stream_mode_run_trains_max_steps_and_names_its_bad_records(reference):
    summary, metrics = kit.read_summary(reference), kit.read_metrics(reference)
    assert summary["actual_steps"] == summary["estimated_steps"] == len(metrics) == STEPS
    assert all(m["packs"] == 2 for m in metrics)
    bad = [json.loads(line) for line in (reference / "bad_records.jsonl").read_text().splitlines()]
    assert {(Path(b["origin"]).name, b["reason"]) for b in bad} == {("mixed.jsonl:26", "invalid_json"),
                                                                    ("mixed.jsonl:27", "missing_image")}
    ledger = summary["epochs"][0]
    assert ledger["records_read"] > 27, "the stream read its source past the end"
    # counted per read (a second pass reads them again), listed once each
    assert ledger["reconciles"] and set(ledger["bad"]) == {"invalid_json", "missing_image"}
    source = summary["sources"]["mixed"]  # named by its file, as indexed sources are
    assert source["records"] == ledger["records_read"] == source["samples"] + sum(source["bad"].values())
    assert load_run_state(reference / CHECKPOINTS / f"step_{STEPS:08d}").data["packs"] == 2 * STEPS


@pytest.mark.slow
@pytest.mark.launch
def test_sigkill_then_resume_auto_continues_the_stream_bit_exactly(reference, data, tmp_path):
    expected = kit.read_metrics(reference)
    overrides = [*common(data, 2), "train.save_every_steps=2", "train.keep_last=1"]
    run = kit.start_forked(RECIPE, tmp_path, overrides)
    run.wait_until(lambda: (tmp_path / CHECKPOINTS / "step_00000002").is_dir())
    run.kill()
    assert not (tmp_path / "summary.json").exists(), "the run finished before it was killed"
    kit.train(RECIPE, tmp_path, [*overrides, "train.resume_from=auto"])
    assert kit.read_metrics(tmp_path) == expected
    assert kit.max_weight_difference(kit.final_weights(tmp_path), kit.final_weights(reference)) == 0


@pytest.mark.slow
@pytest.mark.launch
def test_two_ranks_resume_on_one_rank_with_accumulation_2_and_train_what_the_run_trains_next(reference, data,
                                                                                           tmp_path):
    expected = kit.read_metrics(reference)
    two_ranks = tmp_path / "two_ranks"
    kit.train(RECIPE, two_ranks, [*common(data, 1), "train.save_every_steps=1", "train.keep_last=100"], nproc=2)
    assert_same_training(kit.read_metrics(two_ranks), expected)  # the same packs, dealt over 2 ranks
    checkpoint = two_ranks / CHECKPOINTS / "step_00000004"
    resumed = tmp_path / "resumed"
    kit.train(RECIPE, resumed, [*common(data, 2), f"train.resume_from={checkpoint}"])
    assert_same_training(kit.read_metrics(resumed), expected[4:])
    assert kit.read_summary(resumed)["world_size"] == 1
