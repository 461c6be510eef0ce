"""The step reads (almost) nothing back from the device: packed metadata (positions incl. M-RoPE, ``cu_seqlens``, max
lengths, segment spans) is computed where the batch is collated, on the CPU in the loader's workers
(``mvp_engine.packing.batch_metadata``, ``Recipe.packed_metadata``), and the step uses it as it is.

Counted with ``testkit.host_syncs`` (a ``TorchFunctionMode`` that counts every value read back, copy to the CPU and
data-dependent shape, attributed to the project's code or a library): on the short qwen2_vl run below, before the
metadata moved (main at 3418cd4) 79.5 such calls per micro-batch, 30 from the project's code (``get_rope_index`` per
segment, media checks, ``.tolist()`` and ``torch.equal`` per attention layer in ``sdpa_varlen``, the loss's three
boolean selections, a ``float()`` per micro-batch); now 14, 3 from the project's code (one ``nonzero`` sizing the
supervised positions, the gradient norm and the step loss read once per step).
"""

from __future__ import annotations

import pickle
import types

import pytest
import torch

from mvp_engine.engine import train_step
from mvp_engine.engine.testkit import runs
from mvp_engine.engine.testkit.equivalence import equivalence_case
from mvp_engine.engine.testkit.host_syncs import HostSyncs, counting_host_syncs
from mvp_engine.packing import causal, flash_varlen_kwargs, sliding_window, span_masks
from mvp_engine.packing.batch_metadata import METADATA, PACKED_POSITIONS, carry_bounds
from mvp_engine.packing.varlen_sdpa import sdpa_varlen_attention

PROJECT_PER_MICRO_BATCH = 4  # issue 28's target for the project's own code
TOTAL_PER_MICRO_BATCH = 30  # and for every call, transformers' included
CAUSAL = types.SimpleNamespace(is_causal=True)  # an attention module as sdpa_varlen reads it


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def case(name):
        if name not in made:
            made[name] = equivalence_case(name, tmp_path_factory.mktemp(f"{name}_case"))
        return made[name]

    return case


def test_a_packed_qwen2_vl_step_reads_back_at_most_4_values_per_micro_batch_from_the_projects_code(monkeypatch,
                                                                                                   tmp_path):
    """A short qwen2_vl demo run (greedy packing, micro-batches of 2 packs, collation in 2 loader workers): every
    synchronising call inside ``TrainStep.__call__`` (forward, loss, backward, clipping, the optimizer step)."""
    counted, micro_batches = HostSyncs(), []
    step = train_step.TrainStep.__call__

    def counting_step(self, group, *args, **kwargs):
        with counting_host_syncs() as calls:
            out = step(self, group, *args, **kwargs)
        counted.project.update(calls.project)
        counted.library.update(calls.library)
        micro_batches.append(len(group))
        return out

    monkeypatch.setattr(train_step.TrainStep, "__call__", counting_step)
    runs.train("qwen2_vl", tmp_path / "run", ["+packing=greedy", "demo.num_samples=16",
                                              f"demo.out_dir={tmp_path / 'demo'}", "train.micro_batch_size=2",
                                              "train.num_workers=2", "train.epochs=1"])
    n = sum(micro_batches)
    assert n >= 2, micro_batches
    assert counted.from_project <= PROJECT_PER_MICRO_BATCH * n, counted.describe()
    assert counted.total <= TOTAL_PER_MICRO_BATCH * n, counted.describe()


@pytest.mark.parametrize("recipe,fields", [("qwen2_vl", {METADATA, PACKED_POSITIONS}), ("llava", {METADATA})])
def test_the_collated_metadata_gives_the_kwargs_the_step_computed_itself(cases, recipe, fields):
    """Positions (M-RoPE for qwen2_vl), ``cu_seq_lens`` and max lengths from the collator's metadata equal those
    computed in the step from the batch alone, and the media placement checked there is not checked again: the step
    then reads nothing back; the metadata hook survives pickling (a spawned loader worker gets a copy)."""
    case = cases(recipe)
    model = case.recipe.build_model(case.model_cfg, "sdpa_varlen")
    hook = pickle.loads(pickle.dumps(case.recipe.packed_metadata(model)))
    metadata = hook(case.batch)
    assert set(metadata) == fields
    with counting_host_syncs() as with_metadata:
        ours = case.recipe.prepare_packed({**case.batch, **metadata}, model, "sdpa_varlen")
    with counting_host_syncs() as in_step:
        theirs = case.recipe.prepare_packed(case.batch, model, "sdpa_varlen")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key
    assert with_metadata.total == 0, with_metadata.describe()
    assert in_step.from_project > 4, in_step.describe()  # what moved out of the step
    if recipe == "qwen2_vl":  # the image segments' M-RoPE rows differ from the text row
        assert not torch.equal(theirs["position_ids"][1], theirs["position_ids"][0])


def test_a_misplaced_image_is_refused_where_the_batch_is_collated(cases):
    """The media placement check that moved to the collator still refuses a segment without its image's
    placeholders, in one line, as the step did."""
    case = cases("llava")
    hook = case.recipe.packed_metadata(case.recipe.build_model(case.model_cfg, "sdpa_varlen"))
    assert hook(case.batch)[METADATA].media_checked
    bad = {**case.batch, "input_ids": case.batch["input_ids"].clone()}
    image_token = case.recipe.build_model(case.model_cfg, "sdpa").config.image_token_id
    bad["input_ids"][bad["input_ids"] == image_token] = 0
    with pytest.raises(ValueError, match=r"^row \d+ segment \d+: 0 image tokens but its \d+ image\(s\) need \d+$"):
        hook(bad)


def test_sdpa_varlen_reads_its_spans_from_carried_bounds_without_a_read_back():
    """Per attention layer: ``cu_seq_lens`` carrying their values (``carry_bounds``) cost no ``.tolist()``; the
    result is the same as read from the tensor."""
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]])
    q, k, v = (torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    varlen = flash_varlen_kwargs(segment_ids)
    with counting_host_syncs() as read:
        expected, _ = sdpa_varlen_attention(CAUSAL, q, k, v, None, **varlen)
    bounds = varlen["cu_seq_lens_q"].tolist()
    varlen["cu_seq_lens_q"] = varlen["cu_seq_lens_k"] = carry_bounds(varlen["cu_seq_lens_q"].clone(), bounds)
    with counting_host_syncs() as carried:
        out, _ = sdpa_varlen_attention(CAUSAL, q, k, v, None, **varlen)
    assert torch.equal(out, expected)
    assert read.from_project >= 1 and carried.from_project == 0, (read.describe(), carried.describe())


def test_span_masks_read_back_a_fixed_number_of_values_and_sdpa_varlen_none_per_layer():
    """Gemma's masked spans on sdpa_varlen: building the ``SpanMasks`` reads back as many values for six segments
    as for two (each span's plain-causal verdict read at once, 2 per span before: 68 -> 26 calls per micro-batch on
    the gemma3 demo run of the test above), and a layer given them reads nothing back."""
    predicate = sliding_window(3) & causal()

    def built(lengths):
        segment_ids = torch.tensor([sum(([i] * n for i, n in enumerate(lengths)), [])])
        with counting_host_syncs() as calls:
            spans = span_masks(segment_ids, predicate)
        return spans, calls.from_project

    (_, few), (six, many) = built([5, 7]), built([5, 7, 4, 6, 3, 8])
    assert few == many and sum(mask is not None for mask in six.masks) == 5
    q, k, v = (torch.randn(1, 2, 33, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with counting_host_syncs() as layer:
        sdpa_varlen_attention(CAUSAL, q, k, v, six, sliding_window=3, cu_seq_lens_q=six.cu_seq_lens,
                              cu_seq_lens_k=six.cu_seq_lens)
    assert layer.from_project == 0, layer.describe()
