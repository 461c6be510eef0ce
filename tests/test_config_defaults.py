"""One source of defaults: the config dataclasses. Every recipe's config composed with no overrides holds, in each
group, exactly the dataclass defaults except the overrides listed below on purpose, and every field is a key of the
composed group (so ``train.epochs=2`` works without a ``+``).

Why a test: a YAML that restates a default drifts from it silently (``conf/train/default.yaml`` once said
``epochs: 3`` where ``TrainSpec`` said 1, so a library run and a command-line run trained differently). A new
override is a decision: add it here, with its reason, or put the value in the dataclass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mvp_engine.engine.config import CONF_DIR, DemoSpec, LoraSpec, TrainSpec, compose_config
from mvp_engine.engine.report_config import ReportSpec
from mvp_engine.kit.mllm.data import MLLMDataSpec, MLLMPackingSpec
from mvp_engine.packing import ATTENTION_BACKENDS

RECIPES = sorted(path.stem for path in Path(CONF_DIR).glob("*.yaml"))
# composed node -> its dataclass and the fields it leaves to another group
GROUPS = {
    "train": (TrainSpec, ()),
    "data": (MLLMDataSpec, ("packing",)),  # MLLMDataSpec.packing is the top-level `packing` group
    "demo": (DemoSpec, ()),
    "model.lora": (LoraSpec, ()),
}
PACKINGS = (None, "greedy", "bfd")

# --- the deliberate overrides ---------------------------------------------------------------------------------------

EVERY_RECIPE = {
    "train": {"output_dir": "${hydra:runtime.output_dir}"},  # a Hydra run writes into its run directory
    "data": {"max_seq_len": 1024},  # conf/data/demo.yaml: the tiny demo models' packs; the README's runs use it
}
# one limit, seed and overlong policy for packed and unpacked runs; each group's algorithm (greedy is the default)
FROM_DATA = {"max_seq_len": "${data.max_seq_len}", "overlong": "${data.overlong}", "seed": "${data.seed}"}
PACKING = {
    "greedy": FROM_DATA,
    "bfd": {**FROM_DATA, "strategy": "bfd", "buffer_size": 1_000_000},  # a whole-data-set buffer: one offline plan
}
VIDEO_DEMO = {"demo": {"videos": True, "out_dir": ".cache/demo_video"}}  # recipes that take video train on clips too
DEMO_FITS = {"data": {"max_seq_len": 2304}}  # the demo's longest sample fits: only its records made overlong drop
PER_RECIPE = {
    "gemma3": DEMO_FITS,
    "gemma4": DEMO_FITS,
    "internvl": {"train": {"loss_reduction": "square"}, **DEMO_FITS},  # InternVL's own loss weighting
    "glm4v": VIDEO_DEMO,
    "glm4v_moe": VIDEO_DEMO,
    "qwen2_5_vl": VIDEO_DEMO,
    "qwen3_5": VIDEO_DEMO,
    "qwen3_5_moe": VIDEO_DEMO,
    "qwen3_vl": VIDEO_DEMO,
    # a MoE block holds no nn.Linear for LoRA: adapters on the attention projections only
    "qwen3_vl_moe": {**VIDEO_DEMO, "model.lora": {"target_modules": ["*language_model.layers.*_attn"]}},
}


# --- the check ------------------------------------------------------------------------------------------------------

def defaults_of(spec: type, left_out: tuple[str, ...] = ()) -> dict:
    """Each field's default, read from the dataclass (no instance: ``__post_init__`` may check the machine)."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(spec) if f.name not in left_out}


def overrides_of(node, spec: type, left_out: tuple[str, ...] = ()) -> dict:
    """What a composed node changes from ``spec``'s defaults (interpolations unresolved, as the YAML writes them);
    a key missing from the node or not a field of ``spec`` is reported as such."""
    composed = OmegaConf.to_container(node, resolve=False)
    defaults = defaults_of(spec, left_out)
    assert sorted(composed) == sorted(defaults), f"keys differ from {spec.__name__}'s fields: composed only " \
        f"{sorted(set(composed) - set(defaults))}, fields only {sorted(set(defaults) - set(composed))}"
    return {key: value for key, value in composed.items() if value != defaults[key]}


@pytest.mark.parametrize("packing", PACKINGS, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_composed_config_holds_the_dataclass_defaults_but_the_listed_overrides(recipe, packing):
    cfg = compose_config(recipe, [] if packing is None else [f"+packing={packing}"])
    for group, (spec, left_out) in GROUPS.items():
        expected = {**EVERY_RECIPE.get(group, {}), **PER_RECIPE.get(recipe, {}).get(group, {})}
        assert overrides_of(OmegaConf.select(cfg, group), spec, left_out) == expected, f"{recipe}: {group}"
    if packing is None:
        assert "packing" not in cfg
    else:
        assert overrides_of(cfg.packing, MLLMPackingSpec) == PACKING[packing], f"{recipe}: packing={packing}"


def test_the_report_group_holds_report_spec_defaults():
    """``report.*`` is composed only on request (``+report=default``); the tools fall back to ``ReportSpec``."""
    assert overrides_of(compose_config(RECIPES[0], ["+report=default"]).report, ReportSpec) == {}


def test_the_check_sees_a_changed_default_and_a_missing_key():
    node = OmegaConf.create({**defaults_of(DemoSpec), "num_samples": 12})
    assert overrides_of(node, DemoSpec) == {"num_samples": 12}
    del node["seed"]
    with pytest.raises(AssertionError, match=r"fields only \['seed'\]"):
        overrides_of(node, DemoSpec)


def test_every_field_takes_a_plain_override():
    """No ``+`` needed for a key no YAML writes: the group files extend their dataclass schemas."""
    cfg = compose_config("qwen2_vl", ["+packing=bfd", "train.time_barrier=true", "data.measure_workers=2",
                                      "demo.num_samples=7", "model.lora.merge_on_save=true",
                                      "packing.max_media_per_pack=3"])
    assert (cfg.train.time_barrier, cfg.data.measure_workers, cfg.demo.num_samples, cfg.model.lora.merge_on_save,
            cfg.packing.max_media_per_pack) == (True, 2, 7, True, 3)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_every_attention_group_composes_and_sets_only_its_backend(backend):
    """``attention=<backend>`` is one group file per backend setting ``attention.implementation`` alone: what lets
    each recipe's structure suite check its packing x attention matrix on copies of one composition per packing."""
    chosen, default = compose_config("llava", [f"attention={backend}"]), compose_config("llava")
    assert chosen.attention.implementation == backend
    chosen.attention.implementation = default.attention.implementation
    chosen, default = (OmegaConf.to_container(c, resolve=False) for c in (chosen, default))
    del chosen["hydra"], default["hydra"]  # Hydra's own record of the choices made
    assert chosen == default
