"""Preference pairs in the DataKit: TRL / LLaMA-Factory records from JSON, JSONL and parquet, bad pairs counted by
reason, and a pair encoded as one packing item (prefix once, both continuations after it, positions continuing
from the prefix) that carries exactly the tokens and labels of its two conversations."""

from __future__ import annotations

import pytest
import torch

from mvp_engine.engine.testkit.preference import BAD_PAIRS, write_pairs
from mvp_engine.engine.testkit.structure import compose_config, load_recipe
from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMDataKit, MLLMDataSpec, MLLMPack, MLLMPackingSpec
from mvp_engine.kit.mllm.data.pairs import BRANCH_FIELD, CHOSEN, PREFIX, REJECTED, PairEncoder
from mvp_engine.kit.mllm.data.preference_sources import read_preference_records


@pytest.fixture(scope="module")
def encoder():
    recipe = load_recipe("llava")
    return recipe.build_encoder(recipe.build_processor(compose_config("llava").model))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return list(read_preference_records(write_pairs(tmp_path_factory.mktemp("pairs"))))


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_formats_read_and_bad_pairs_counted(tmp_path, suffix):
    bad = []
    records = list(read_preference_records(write_pairs(tmp_path, suffix, bad=True), on_bad=bad.append))
    expected = ["trl-img", "trl-text"] if suffix == ".parquet" else ["trl-img", "lf-multi", "trl-text"]
    assert [r.record_id for r in records] == expected
    assert sorted(err.reason for err in bad) == sorted(BAD_PAIRS)
    assert all(str(err).startswith(f"{tmp_path / ('pairs' + suffix)}:") for err in bad)
    first = records[0]
    assert first.image_paths == [str(tmp_path / "wide.png")]
    assert first.messages[:-1] == first.rejected[:-1]  # one prompt, two answers
    assert first.messages[-1]["role"] == first.rejected[-1]["role"] == "assistant"


def test_bad_pair_raises_without_on_bad(tmp_path):
    with pytest.raises(ValueError, match="pairs.jsonl:4: pair has no .rejected. answer"):
        list(read_preference_records(write_pairs(tmp_path, bad=True)))


@pytest.mark.parametrize("shared", [True, False])
def test_pair_sample_is_its_two_conversations(encoder, pairs, shared):
    pair_encoder = PairEncoder(encoder, shared_prefix=shared)
    for record in pairs:
        sample = pair_encoder.encode(record)
        assert pair_encoder.measure(record).length == sample.length
        branches = sample.token_fields[BRANCH_FIELD]
        positions = MLLMPack([sample]).to_model_inputs()["position_ids"]
        prefix = int((branches == PREFIX).sum())
        assert (prefix > 0) == shared
        assert sample.num_media == len(record.image_paths) * (1 if shared else 2)
        for branch, conversation in zip((CHOSEN, REJECTED), pair_encoder.unpaired(record)):
            view = (branches == PREFIX) | (branches == branch)
            assert torch.equal(sample.input_ids[view], conversation.input_ids)
            assert torch.equal(positions[view], torch.arange(conversation.length))
            own = branches == branch
            assert torch.equal(sample.labels[own], conversation.labels[prefix:])
            assert sample.labels[own][0] == IGNORE_INDEX  # each continuation starts unsupervised
        assert (sample.labels[branches == PREFIX] == IGNORE_INDEX).all()
    multi = pair_encoder.unpaired(next(r for r in pairs if r.record_id == "lf-multi"))[0]
    supervised = encoder.tokenizer.decode(multi.labels[multi.labels != IGNORE_INDEX])
    assert "No clear shapes." in supervised and "Noise." not in supervised  # the prompt's own answer is not trained


def test_overlong_pair_is_dropped_not_truncated(encoder, pairs):
    lengths = [PairEncoder(encoder).measure(r).length for r in pairs]
    cap = sorted(lengths)[1]  # the longest pair does not fit
    spec = MLLMDataSpec(packing=MLLMPackingSpec(max_seq_len=cap, strategy="greedy", overlong="truncate"),
                        max_seq_len=cap, overlong="truncate")
    dataset = MLLMDataKit.build_dataset(spec, PairEncoder(encoder), records=pairs)
    plan = dataset.plan(0)
    longest = lengths.index(max(lengths))
    assert longest in plan.dropped and not plan.truncated
    served = [i for group in dataset.rank_packs(0) for i in group]
    assert sorted(served) == sorted(set(range(len(pairs))) - {longest})
