"""A packed DPO step computes exactly what pair-by-pair unpacked DPO computes: loss, rewards and every gradient
(<= 1e-5 relative, fp32 on CPU), with the prefix shared or duplicated, on eager, sdpa and sdpa_varlen, for every
loss type, the reference being the policy with its LoRA adapters off (random adapters, so policy and reference
differ) or a frozen copy.

The packed side is the engine's (``preference.PreferenceObjective``: the pairs packed by the DataKit, the recipe's
``prepare_packed``, the chunked log-prob path); the unpacked side runs each conversation alone through the recipe's
``prepare_padded`` (the model's own positions and causal mask), takes full-logit ``log_softmax`` sums and applies
each loss's formula pair by pair."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mvp_engine.engine.config import LoraSpec, TrainSpec
from mvp_engine.engine.device import DEVICE_ENV
from mvp_engine.engine.parallel import ParallelLayout, shard_frozen
from mvp_engine.engine.preference import (
    PreferenceObjective,
    PreferenceSpec,
    adapters_disabled,
    frozen_copy,
    prefix_obstacle,
)
from mvp_engine.engine.testkit.equivalence import collate_rows, with_random_adapters
from mvp_engine.engine.testkit.preference import write_pairs
from mvp_engine.engine.testkit.structure import compose_config, load_recipe
from mvp_engine.kit.mllm.data import IGNORE_INDEX
from mvp_engine.kit.mllm.data.pairs import BRANCH_FIELD, PairEncoder
from mvp_engine.kit.mllm.data.preference_sources import read_preference_records
from mvp_engine.packing import packed_attention_kwargs
from mvp_engine.packing.branches import same_branch_or_prefix
from mvp_engine.packing.mask_forms import CAUSAL

TOL = 1e-5
LORA = LoraSpec(r=4)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return list(read_preference_records(write_pairs(tmp_path_factory.mktemp("pairs"))))


def _sequence_logprob(model, recipe, sample, pad, backend):
    batch = collate_rows([[sample]], pad, extra_pad=0)
    logits = model(**recipe.prepare_padded(batch, model, backend)).logits[0]
    targets = batch["labels"][0, 1:]
    keep = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits[:-1].float(), -1)[keep].gather(1, targets[keep, None])
    return logprobs.sum(), float(keep.sum())


def _pair_loss(spec, pc, pr, rc, rr, nc, nr):
    """One pair's loss and rewards, written out per loss type (TRL's formulas)."""
    beta, eps = spec.beta, spec.label_smoothing
    if spec.loss_type == "simpo":
        logits = beta * (pc / nc - pr / nr) - spec.simpo_gamma
        loss = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        rewards = (beta * pc / nc, beta * pr / nr)
    else:
        margin = (pc - rc) - (pr - rr)
        if spec.loss_type == "ipo":
            loss = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
        elif spec.loss_type == "hinge":
            loss = torch.relu(1 - beta * margin)
        else:
            loss = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
        rewards = (beta * (pc - rc), beta * (pr - rr))
    return loss - spec.sft_weight * pc / nc, [float(r.detach()) for r in rewards]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check_dpo_step(name, backend, spec, records):
    recipe, model_cfg = load_recipe(name), compose_config(name).model
    processor = recipe.build_processor(model_cfg)
    encoder = PairEncoder(recipe.build_encoder(processor), spec.shared_prefix)
    pad = recipe.pad_token_id(processor)
    # float64: a DPO gradient is a difference of the two answers' gradients, whose fp32 rounding (1e-6 of each)
    # the cancellation can lift past TOL (measured: 1.1e-5 on qwen2_vl eager); in float64 any leak between the
    # answers or the pairs still shows at full size, rounding does not
    model = with_random_adapters(recipe.build_model(model_cfg, backend), LORA).double()
    reference = frozen_copy(model) if spec.reference == "copy" else None
    if reference is not None:  # the copy must differ from the policy: perturb the policy's adapters further
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if ".lora_B." in pname:
                    param.mul_(1.5)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    samples = [encoder.encode(record) for record in records]
    batch = collate_rows([samples[:2], samples[2:]], pad)
    objective = PreferenceObjective(spec, reference)
    part, _ = objective.loss(model, batch, lambda m, b: (m(**recipe.prepare_packed(b, m, backend)), None),
                             chunk_tokens=16)
    packed_loss = part.weighted_sum / part.weight_total
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in params}
    metrics = objective.step_metrics()
    model.zero_grad(set_to_none=True)

    losses, chosen_rewards, rejected_rewards = [], [], []
    for record in records:
        chosen, rejected = encoder.unpaired(record)
        (pc, nc), (pr, nr) = (_sequence_logprob(model, recipe, s, pad, backend) for s in (chosen, rejected))
        with torch.no_grad():
            if spec.reference == "copy":
                (rc, _), (rr, _) = (_sequence_logprob(reference, recipe, s, pad, backend) for s in (chosen, rejected))
            else:
                with adapters_disabled(model):
                    (rc, _), (rr, _) = (_sequence_logprob(model, recipe, s, pad, backend) for s in (chosen, rejected))
        loss, rewards = _pair_loss(spec, pc, pr, rc, rr, nc, nr)
        losses.append(loss)
        chosen_rewards.append(rewards[0])
        rejected_rewards.append(rewards[1])
    unpacked_loss = torch.stack(losses).mean()
    unpacked_loss.backward()

    assert math.isclose(packed_loss.item(), unpacked_loss.item(), rel_tol=TOL, abs_tol=1e-7)
    # a reward is beta x a difference of two log-probability sums of similar size: exact to TOL of those sums
    scale = TOL * spec.beta * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    for key, expected in (("rewards/chosen", sum(chosen_rewards) / 3), ("rewards/rejected", sum(rejected_rewards) / 3)):
        assert math.isclose(metrics[key], expected, abs_tol=scale), (key, metrics[key], expected)
    accuracy = sum(c > r for c, r in zip(chosen_rewards, rejected_rewards)) / 3
    assert metrics["rewards/accuracy"] == accuracy
    worst = max(_relative(packed_grads[n], p.grad) for n, p in params if p.grad.norm() > 0)
    assert worst <= TOL, worst
    assert all(packed_grads[n].norm() > 0 for n, p in params if ".lora_" in n), "every adapter gets a gradient"
    return model, encoder.encoder, pad


@pytest.mark.parametrize("name,backend,shared", [(name, backend, True) for name in ("llava", "qwen2_vl")
                                                  for backend in ("eager", "sdpa", "sdpa_varlen")]
                         + [("llava", "sdpa", False), ("qwen2_vl", "sdpa", False)])
def test_packed_dpo_equals_pair_by_pair(records, name, backend, shared):
    """sdpa_varlen shares the prefix without a mask: each continuation's attention over the prefix and over itself,
    merged by log-sum-exp (``packing.prefix_attention``)."""
    spec = PreferenceSpec(beta=0.5, label_smoothing=0.1, sft_weight=0.3, shared_prefix=shared)
    check_dpo_step(name, backend, spec, records)


@pytest.mark.parametrize("loss_type,reference", [("ipo", "adapters_off"), ("hinge", "copy"), ("simpo", "copy")])
def test_loss_types_and_references(records, loss_type, reference):
    check_dpo_step("llava", "sdpa", PreferenceSpec(loss_type=loss_type, beta=0.5, reference=reference), records)


def test_bad_spec_is_one_line():
    with pytest.raises(ValueError, match=r"^dpo\.loss_type='kto' is invalid"):
        PreferenceSpec(loss_type="kto")
    with pytest.raises(ValueError, match=r"^dpo\.reference='frozen' is invalid"):
        PreferenceSpec(reference="frozen")


@pytest.mark.parametrize("name,backend", [("llava", "sdpa_varlen"), ("qwen3_5", "sdpa")])
def test_duplicated_prefix_on_what_cannot_share_it(records, name, backend, monkeypatch):
    """Each conversation a segment of its own: varlen kernels (flash's layout, computed here through sdpa_varlen)
    and linear-attention layers (Qwen3.5) need nothing more than their packed boundaries. The shared layout is
    refused in one line where it cannot be kept apart: flash's kwargs, linear-attention layers; a CPU run
    duplicates the prefix for those alone (``prefix_obstacle``), not for sdpa_varlen."""
    model, encoder, pad = check_dpo_step(name, backend, PreferenceSpec(beta=0.5, shared_prefix=False), records)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    linear = "its linear-attention layers carry a recurrent state along the segment"
    assert prefix_obstacle(model, "sdpa_varlen") == (linear if name == "qwen3_5" else None)
    assert prefix_obstacle(model, "flash_attention_2") == (linear if name == "qwen3_5" else
                                                           "flash_attention_2 takes one causal span per segment")
    batch = collate_rows([[PairEncoder(encoder).encode(records[0])]], pad)
    if name == "qwen3_5":
        with pytest.raises(ValueError, match="not supported on models with linear-attention layers"):
            load_recipe(name).prepare_packed(batch, model, backend)
    branches = same_branch_or_prefix(batch[BRANCH_FIELD])
    with pytest.raises(ValueError, match="^flash_attention_2 cannot mask a preference pair's branches"):
        packed_attention_kwargs(batch, "flash_attention_2", torch.float32, predicate=CAUSAL & branches,
                                branches=batch[BRANCH_FIELD])


@pytest.mark.slow
@pytest.mark.parametrize("name,backend,shared", [(name, backend, shared) for name, shared in
                                                  (("qwen3_vl", True), ("gemma3", False))
                                                  for backend in ("sdpa", "sdpa_varlen")])
def test_more_families(records, name, backend, shared):
    """Qwen3-VL's M-RoPE (interleaved sections, timestamps) with the prefix shared; Gemma 3 (sliding windows,
    bidirectional image blocks) with it duplicated, the layout its run takes."""
    check_dpo_step(name, backend, PreferenceSpec(beta=0.5, shared_prefix=shared), records)


def test_a_sharded_copy_computes_what_the_whole_copy_computes(records, tmp_path):
    """``dpo.reference=copy`` under FSDP2 (``parallel.shard_frozen``, on a 1-process gloo group here; 2 ranks in
    tests/test_dpo_runs.py): every parameter of the copy a frozen DTensor shard; the pairs' reference log-probs
    equal the unsharded copy's; after the pass the copy holds shards only again (FSDP2 would keep its root, the
    embeddings and the head, gathered for a backward the copy never runs)."""
    recipe, model_cfg = load_recipe("llava"), compose_config("llava").model
    processor = recipe.build_processor(model_cfg)
    model = recipe.build_model(model_cfg, "sdpa")
    batch = collate_rows([[PairEncoder(recipe.build_encoder(processor)).encode(r) for r in records]],
                         recipe.pad_token_id(processor))
    spec = PreferenceSpec(reference="copy")

    def forward(m, b):
        return m(**recipe.prepare_packed(b, m, "sdpa")), None

    whole = PreferenceObjective(spec, frozen_copy(model)).reference_logprobs(model, batch, forward, nullcontext, 16)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        copy = frozen_copy(model)
        shard_frozen(copy, ParallelLayout(1, 0, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))),
                     TrainSpec(sharding="fsdp2"))
        assert all(isinstance(p, DTensor) and not p.requires_grad for p in copy.parameters())
        sharded = PreferenceObjective(spec, copy).reference_logprobs(model, batch, forward, nullcontext, 16)
        assert all(isinstance(p, DTensor) for p in copy.parameters()), "the root stays gathered"
    finally:
        torch.distributed.destroy_process_group()
    for name in ("chosen", "rejected"):
        torch.testing.assert_close(getattr(sharded, name), getattr(whole, name), rtol=1e-6, atol=1e-5)
