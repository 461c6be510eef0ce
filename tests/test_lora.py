"""``model.lora`` for real (llava, gloo): adapters on the language model and the projector, ``lm_head`` trained in
full beside them (``modules_to_save``), part of the projector's adapters frozen by ``model.freeze``.

One process accumulating 2 micro-batches is the reference, with a checkpoint after every step: 2 DDP ranks and 2
FSDP2 ranks train what it trains (losses, grad norms, the saved adapters); resuming from one of its checkpoints
reproduces the rest of its metrics and adapters exactly, from a checkpoint that holds only the trainable tensors and
their AdamW state; its ``model/`` folder loads with peft onto the recipe's base and gives the logits of
``model/merged`` loaded with ``model.pretrained``; FSDP2 from a pretrained folder adapts the weights rank 0
broadcasts. Packed == one-by-one with adapters: the testkit's
``EquivalenceSuite``; FLOPs of a frozen base: ``tests/test_flops.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForImageTextToText

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS
from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.lora import MERGED, add_adapters, lora_spec

RECIPE = "llava"
COVERS = ("LoRA", "resume", "DDP", "FSDP2")  # on RECIPE, for the coverage table (testkit.coverage)
TARGETS = '["*language_model.layers.*_attn","*language_model.layers.*.mlp",model.multi_modal_projector]'
LORA = ["model.lora.r=4", f"model.lora.target_modules={TARGETS}", "model.lora.modules_to_save=[lm_head]",
        "model.lora.merge_on_save=true", "model.freeze=[model.multi_modal_projector.linear_2]"]
ADAPTER = "adapter_model.safetensors"


def common(data: Path) -> list[str]:
    return ["+packing=greedy", f"data.sources=[{data}]", "data.shuffle=false", "data.max_seq_len=160",
            "train.epochs=2", "train.micro_batch_size=1", "train.learning_rate=5e-3", "train.warmup_ratio=0.2",
            "train.keep_last=100", *LORA]


def adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / ADAPTER))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return kit.write_mixed_jsonl(tmp_path_factory.mktemp("lora_data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_one")
    kit.train(RECIPE, run_dir, [*common(data), "train.gradient_accumulation_steps=2", "train.save_every_steps=1"])
    return run_dir


def test_bad_lora_settings_stop_with_one_line_naming_the_key():
    cfg = kit.compose_config(RECIPE)
    model = kit.load_recipe(RECIPE).build_model(cfg.model, "sdpa")
    for override, message in [("model.lora.r=-1", "model.lora.r=-1 is invalid"),
                              ("model.lora.dropout=1.5", "model.lora.dropout=1.5 is invalid"),
                              ("model.lora.target_modules=[model.nothing]", "'model.nothing' matches no module"),
                              ("model.lora.target_modules=[model.language_model.norm]", "has no nn.Linear"),
                              ("model.lora.modules_to_save=[head]", "'head' is not a module name")]:
        with pytest.raises(ConfigError, match=message):
            add_adapters(model, lora_spec(kit.compose_config(RECIPE, ["model.lora.r=4", override]).model))
    assert add_adapters(model, lora_spec(cfg.model)) is model and all(p.requires_grad for p in model.parameters())


def test_the_run_trains_only_adapters_and_saves_an_adapter_folder_and_a_merged_model(reference):
    summary = kit.read_summary(reference)
    assert summary["lora"]["r"] == 4 and summary["lora"]["alpha"] == 8.0
    saved = adapters(reference)
    assert saved and all(".lora_A." in k or ".lora_B." in k or k == "base_model.model.lm_head.weight"
                         for k in saved), list(saved)
    # what trained: the adapters and the head's copy, less the projector adapter model.freeze froze
    assert summary["parameters"]["trainable"] == sum(v.numel() for k, v in saved.items() if "linear_2" not in k)
    config = json.loads((reference / "model" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["modules_to_save"] == ["lm_head"]
    # peft loads the folder onto the recipe's base; model.pretrained loads the merged model: same logits
    recipe = kit.load_recipe(RECIPE)
    base = recipe.build_model(kit.compose_config(RECIPE).model, "sdpa")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    loaded = PeftModel.from_pretrained(base, reference / "model").eval()
    merged = recipe.build_model(kit.compose_config(RECIPE, [f"model.pretrained={reference / 'model' / MERGED}"])
                                .model, "sdpa").eval()
    ids = torch.randint(10, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted, flat = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
        loaded.base_model.disable_adapter_layers()
        plain = loaded(input_ids=ids).logits
    assert (adapted - flat).abs().max() <= 1e-5
    assert (adapted - plain).abs().max() > 1e-3, "the adapters changed nothing"
    # the frozen base came out of training unchanged; the merged model changed only what was adapted or saved
    merged_state = merged.state_dict()
    changed = {k for k, v in before.items() if not torch.equal(v, merged_state[k])}
    assert changed and all(".self_attn." in k or ".mlp." in k or "multi_modal_projector.linear_1" in k
                           or k.startswith("lm_head") for k in changed), sorted(changed)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(reference):
    checkpoint = reference / CHECKPOINTS / "step_00000001"
    keys = list(FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k or ".modules_to_save." in k for k in weights), weights
    assert not any("linear_2.lora" in k for k in weights), "model.freeze froze the projector's second adapter"
    moments = {k.removeprefix("optimizer.state.").removesuffix(".exp_avg") for k in keys
               if k.startswith("optimizer.state.") and k.endswith(".exp_avg")}
    assert moments == {k.removeprefix("model.") for k in weights}


def test_resume_reproduces_the_rest_of_the_run(reference, data, tmp_path):
    expected = kit.read_metrics(reference)
    step = len([m for m in expected if m["epoch"] == 0]) // 2
    kit.train(RECIPE, tmp_path, [*common(data), "train.gradient_accumulation_steps=2",
                                 f"train.resume_from={reference / CHECKPOINTS / f'step_{step:08d}'}"])
    assert kit.read_metrics(tmp_path) == expected[step:]
    assert kit.max_weight_difference(adapters(tmp_path), adapters(reference)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
def test_two_ranks_train_the_adapters_one_rank_accumulating_two_trains(reference, data, tmp_path, sharding):
    out = kit.train(RECIPE, tmp_path, [*common(data), f"train.sharding={sharding}"], nproc=2).stdout
    if sharding == "fsdp2":
        assert "sharding: fsdp2 over 2 ranks" in out, out
    two, one = kit.read_metrics(tmp_path), kit.read_metrics(reference)
    assert [m["lr"] for m in two] == [m["lr"] for m in one]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(two, one)) <= 1e-5
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(two, one)) <= 1e-4
    assert kit.max_weight_difference(adapters(tmp_path), adapters(reference)) <= 1e-5
    merged = [load_file(str(run / "model" / MERGED / "model.safetensors")) for run in (tmp_path, reference)]
    assert kit.max_weight_difference(*merged) <= 1e-5
    summary = kit.read_summary(tmp_path)
    assert summary["sharding"] == sharding and summary["parameters"] == kit.read_summary(reference)["parameters"]


@pytest.mark.slow
def test_fsdp2_from_a_pretrained_folder_adapts_the_broadcast_weights(reference, data, tmp_path):
    """Rank 1 builds the base on the meta device, peft adds the adapters there, rank 0's weights arrive as shards:
    a lost shard or adapter would change the first loss. The base is the reference's merged model; its adapter
    folder records that base, so transformers' own from_pretrained loads it with the adapters applied."""
    base = reference / "model" / MERGED
    overrides = [*common(data), "train.epochs=1", f"model.pretrained={base}"]
    kit.train(RECIPE, tmp_path / "two", [*overrides, "train.sharding=fsdp2"], nproc=2)
    kit.train(RECIPE, tmp_path / "one", [*overrides, "train.gradient_accumulation_steps=2"])
    two, one = kit.read_metrics(tmp_path / "two"), kit.read_metrics(tmp_path / "one")
    assert abs(two[0]["loss"] - one[0]["loss"]) <= 1e-6
    assert kit.max_weight_difference(adapters(tmp_path / "two"), adapters(tmp_path / "one")) <= 1e-5
    config = json.loads((tmp_path / "two" / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert hasattr(AutoModelForImageTextToText.from_pretrained(tmp_path / "two" / "model"), "peft_config")
