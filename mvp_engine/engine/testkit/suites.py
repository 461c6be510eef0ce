"""Ready-made pytest test classes over the kit's checks: a recipe's test file subclasses one and names the recipe.

    # recipes/<name>/tests/test_smoke.py
    from mvp_engine.engine.testkit.suites import SmokeSuite

    class TestSmoke(SmokeSuite):
        recipe = "<name>"

The suites hold no recipe knowledge; a recipe adds its model-specific tests next to them (Qwen2-VL: golden M-RoPE
positions, guards, the transformers traps). Kept apart from ``mvp_engine.engine.testkit`` itself so importing the kit
(tools do) does not import pytest.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest

import mvp_engine.engine.testkit as kit
from mvp_engine.packing import ATTENTION_BACKENDS, BACKENDS
from mvp_engine.packing.backends import FLEX

from ..config import AUTO_ATTENTION, ConfigError, check_attention, resolve_attention
from ..lora import LoraSpec
from . import experts

SELECTION_MARKERS = ("slow", "launch", "gpu")


def inherited_markers(cls: type, name: str) -> list[str]:
    """The selection markers (``slow`` / ``launch`` / ``gpu``) a suite's check ``name`` carries where a base class
    defines it but its override in ``cls`` does not: pytest reads an overriding method's own marks only, so a
    recipe that overrides a launch-marked check to add assertions would run it in ``make test-fast``'s lane (and a
    ``gpu`` one on a CPU). The root conftest adds them back to every collected test."""
    own = {mark.name for mark in getattr(cls.__dict__.get(name), "pytestmark", [])}
    based = {mark.name for base in cls.__mro__[1:] if name in base.__dict__
             for mark in getattr(base.__dict__[name], "pytestmark", [])}
    return sorted((based - own) & set(SELECTION_MARKERS))


def backend_params(backends, training: bool) -> list:
    """``backends`` as pytest parameters, those that need CUDA for the case (``kit.needs_cuda``) marked ``gpu``:
    on a GPU machine they run there, every other case runs as on a CPU machine (``conftest.py``). flex_attention
    cases are ``slow``: each compiles its kernel (10-25 s on a CPU), so CI runs them and ``make test-fast`` not."""
    def marks(backend: str) -> list:
        return [mark for mark, applies in ((pytest.mark.gpu, kit.needs_cuda(backend, training)),
                                           (pytest.mark.slow, backend == FLEX)) if applies]

    return [pytest.param(b, marks=marks(b)) for b in backends]


_CASES: dict[str, kit.EquivalenceCase] = {}


def shared_case(recipe: str, tmp_path_factory) -> kit.EquivalenceCase:
    """The recipe's equivalence case (``kit.equivalence_case``), encoded once per session and shared by its
    ``EquivalenceSuite`` and ``ContextParallelSuite``: the suites only read it (its one-by-one reference is computed
    once and kept on it; a check needing another model config copies it)."""
    if recipe not in _CASES:
        _CASES[recipe] = kit.equivalence_case(recipe, tmp_path_factory.mktemp(f"{recipe}_case"))
    return _CASES[recipe]


class RecipeSuite:
    """Base: ``recipe`` names ``recipes/<recipe>`` (and ``conf/<recipe>.yaml``)."""

    recipe: str = ""


class StructureSuite(RecipeSuite):
    def test_recipe_has_entry_point_encoder_and_prepare_packed(self):
        kit.check_structure(self.recipe)

    def test_every_packing_and_attention_combination_composes(self):
        assert kit.check_all_combinations_compose(self.recipe) == len(kit.PACKINGS) * len(ATTENTION_BACKENDS)

    def test_bad_config_stops_with_one_line_naming_the_key(self, tmp_path, monkeypatch, capsys):
        """The recipe's own Hydra entry point (``python -m recipes.<name>.train``), run in this process: a fresh
        interpreter per recipe cost ~10 s of imports; the CLI itself is launched by the engine's tests."""
        monkeypatch.setattr(sys, "argv", [f"recipes/{self.recipe}/train.py", "+packing=greedy",
                                          "packing.strategy=zigzag", f"train.output_dir={tmp_path}",
                                          f"hydra.run.dir={tmp_path / 'hydra'}"])
        with pytest.raises(SystemExit) as stopped:
            importlib.import_module(f"recipes.{self.recipe}.train").main()
        assert stopped.value.code == 1
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith("config error: packing.strategy='zigzag' is invalid"), err
        assert "Traceback" not in err


class SmokeSuite(RecipeSuite):
    """``packings``: the modes to train (default all); a recipe whose packing differs from another's only in its
    model hooks may run fewer, the engine-level tests covering the planners. ``overrides``: more keys of every run
    (a MoE recipe: its load-balancing loss on)."""

    packings: tuple[str | None, ...] = kit.PACKINGS
    overrides: tuple[str, ...] = ()

    def pytest_generate_tests(self, metafunc):
        if "packing" in metafunc.fixturenames:
            metafunc.parametrize("packing", self.packings)

    def test_smoke_training(self, packing, tmp_path):
        summary = kit.smoke_run(self.recipe, packing, tmp_path / "run", self.overrides)
        kit.check_smoke_summary(summary)
        assert summary["packing"] == packing


class EquivalenceSuite(RecipeSuite):
    """Packed == one-by-one for every backend the recipe declares (skipped, with the reason, where this machine
    cannot run it); the flash kwargs through sdpa_varlen on CPU; activation checkpointing exact on the packed case
    for every backend this machine trains with."""

    covers = ("packed == one-by-one", "LoRA", "recompute")  # what it tests on its recipe (testkit.coverage)
    training_tests = ("test_activation_checkpointing_is_exact_and_recomputes",)  # the others run forward only

    def pytest_generate_tests(self, metafunc):
        if "backend" in metafunc.fixturenames:
            training = metafunc.function.__name__ in self.training_tests
            metafunc.parametrize("backend", backend_params(kit.load_recipe(self.recipe).attention_backends, training))

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tmp_path_factory):
        return shared_case(cls.recipe, tmp_path_factory)

    def test_packed_equals_one_by_one(self, case, backend):
        try:
            check_attention(backend, case.recipe.attention_backends, training=False)
        except ConfigError as err:
            pytest.skip(str(err))
        report = kit.run_equivalence(case, backend)
        print("\n".join(report.lines()))
        report.check()

    def test_packed_equals_one_by_one_with_lora_adapters(self, case):
        """One case, on the backend a packed run trains with here (``attention=auto``): adapters on every linear
        layer under ``model`` (language model, vision tower, projector), random B so they change the logits; the
        gradients compared are the adapters'."""
        backend = resolve_attention(AUTO_ATTENTION, case.recipe.attention_backends, packed=True)
        report = kit.run_equivalence(case, backend, lora=LoraSpec(r=4, target_modules=["model"]))
        print("\n".join(report.lines()))
        report.check()

    def test_flash_kwargs_through_sdpa_varlen(self, case):
        if "flash_attention_2" not in case.recipe.attention_backends:
            pytest.skip(f"{self.recipe} offers no flash attention")
        kit.check_flash_kwargs_with_reference_attention(case)

    def test_withheld_linear_attention_boundaries_are_caught(self, case):
        report = kit.check_withheld_linear_boundaries_are_caught(case)
        if report is None:
            pytest.skip(f"{self.recipe} has no linear-attention layers")
        print("\n".join(report.lines()))

    def test_activation_checkpointing_is_exact_and_recomputes(self, case, backend):
        try:
            check_attention(backend, case.recipe.attention_backends)  # a backend this machine trains with
        except ConfigError as err:
            pytest.skip(str(err))
        report = kit.run_recompute_check(case, backend)
        print("\n".join(report.lines()))
        report.check()

    def test_declared_unreachable_parameters_get_no_gradient(self, case):
        kit.check_unreachable_parameters_are_unreachable(case)

    def test_dummy_media_pass_reaches_every_media_parameter_with_zero(self, case):
        assert kit.check_dummy_media_pass(case) > 0


class ExpertsSuite(RecipeSuite):
    """A mixture-of-experts recipe's own checks on its equivalence case (``testkit.experts``): every experts
    implementation this CPU runs computes the same logits and expert gradients, and the model's own aux loss stays
    off in the recipe's kwargs."""

    covers = ()  # beyond the coverage table's features

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tmp_path_factory):
        return shared_case(cls.recipe, tmp_path_factory)

    def test_experts_implementations_agree(self, case):
        print(experts.check_experts_implementations_agree(case))

    def test_the_models_own_aux_loss_stays_off(self, case):
        experts.check_model_aux_loss_stays_off(case)


class DistributedSuite(RecipeSuite):
    """The distributed contract, one 2-rank run per sharding: FSDP2 over 2 gloo ranks, from a pretrained folder
    (rank 0 alone reads it, the others receive their shards), with the recipe's ``sharded_freeze`` patterns frozen,
    packed, on data whose micro-batches alternate image and text-only samples, trains what 1 rank x accumulation 2
    trains unsharded (same lr column and samples, losses, grad norms, final weights), and its gathered
    ``save_pretrained`` folder loads back with ``model.pretrained``. DDP over the world is the
    ``ContextParallelSuite``'s run (a recipe whose rows cannot split adds ``"none"`` to ``shardings``); the model-free
    reduction x sharding matrix (token / sample / square, DDP / FSDP2, an uneven last step) is the engine's
    (``tests/test_distributed_matrix.py``)."""

    reduction: str = "sample"  # train.loss_reduction of the contract run
    packing: str = "greedy"  # its packing (bfd: one whole epoch planned before the first step)
    sharded_freeze: tuple[str, ...] = ()  # model.freeze patterns (whole sharding units, or parts)
    shardings: tuple[str, ...] = ("fsdp2",)  # train.sharding values run against the one 1-rank reference
    overrides: tuple[str, ...] = ()  # more keys of both runs (a MoE recipe: its load-balancing loss on)
    FEATURES = {"fsdp2": "FSDP2", "none": "DDP"}
    covers = ("FSDP2",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.covers = tuple(cls.FEATURES[s] for s in cls.shardings)  # what it tests on its recipe (testkit.coverage)

    def pytest_generate_tests(self, metafunc):
        if "sharding" in metafunc.fixturenames:
            metafunc.parametrize("sharding", list(self.shardings))

    @pytest.fixture(scope="class")
    @classmethod
    def pretrained(cls, tmp_path_factory):
        """The recipe's tiny model and processor saved as a pretrained folder."""
        folder = tmp_path_factory.mktemp(f"{cls.recipe}_pretrained")
        recipe, cfg = kit.load_recipe(cls.recipe), kit.compose_config(cls.recipe)
        recipe.build_model(cfg.model, "sdpa").save_pretrained(folder)
        recipe.build_processor(cfg.model).save_pretrained(folder)
        return folder

    def common(self, pretrained) -> list[str]:
        freeze = [f"model.freeze=[{','.join(self.sharded_freeze)}]"] if self.sharded_freeze else []
        return [*kit.packing_overrides(self.packing), f"data.sources=[{kit.shared_mixed_jsonl()}]",
                "data.shuffle=false", "data.max_seq_len=160", "train.epochs=2", "train.micro_batch_size=1",
                "train.learning_rate=5e-3", "train.warmup_ratio=0.2", f"train.loss_reduction={self.reduction}",
                f"model.pretrained={pretrained}", *freeze, *self.overrides]

    @pytest.mark.slow
    @pytest.mark.launch
    def test_two_ranks_train_what_one_rank_accumulating_two_trains(self, sharding, pretrained, tmp_path):
        self.check_two_ranks(pretrained, tmp_path / "two", sharding)

    def check_two_ranks(self, pretrained, two_dir, sharding: str, split_overrides: tuple[str, ...] = ()) -> str:
        """The contract run's checks for a 2-rank run under ``sharding`` with ``split_overrides`` (e.g. a MoE
        recipe's ``train.expert_parallel_size=2``) against the class's one 1-rank reference (``kit.cached_run``:
        shared by every check of the class in a session); returns the 2-rank run's stdout."""
        out = kit.train(self.recipe, two_dir, [*self.common(pretrained), f"train.sharding={sharding}",
                                               "train.gradient_accumulation_steps=1", *split_overrides],
                        nproc=2).stdout
        one_dir = kit.cached_run(self.recipe, [*self.common(pretrained), "train.gradient_accumulation_steps=2"])
        two, one = kit.read_metrics(two_dir), kit.read_metrics(one_dir)
        assert ("sharding: fsdp2 over 2 ranks" in out) == (sharding == "fsdp2"), out
        if sharding == "fsdp2":
            assert re.search(r"this rank holds [\d,]+ of [\d,]+ parameter elements", out), out
        assert [m["lr"] for m in two] == [m["lr"] for m in one]
        assert [m["samples"] for m in two] == [m["samples"] for m in one]
        assert abs(two[0]["loss"] - one[0]["loss"]) <= 1e-6  # a wrong or missing shard changes the first step
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(two, one)) <= 1e-5
        assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(two, one)) <= 1e-4
        if "aux_loss" in one[0]:  # a MoE model's load-balancing term, counted over every rank's real tokens
            assert max(abs(a["aux_loss"] - b["aux_loss"]) for a, b in zip(two, one)) <= 1e-5
            assert [a["expert_load"] for a in two] == [b["expert_load"] for b in one]
        difference = kit.max_weight_difference(kit.final_weights(two_dir), kit.final_weights(one_dir))
        print(f"{self.recipe} 2 ranks {sharding} {' '.join(split_overrides)} vs 1 rank x accumulation 2: "
              f"{len(two)} steps, max differences: " + ", ".join(
                  f"{key} {max(abs(a[key] - b[key]) for a, b in zip(two, one)):.1e}"
                  for key in ("loss", "aux_loss", "grad_norm") if key in one[0]) + f", weights {difference:.1e}")
        assert difference <= 1e-5, f"parameters differ by {difference}"
        summary = kit.read_summary(two_dir)
        assert summary["world_size"] == 2 and summary["sharding"] == sharding
        assert summary["steps_per_rank_this_session"] == [summary["estimated_steps"]] * 2 == [len(two)] * 2
        assert summary["parameters"] == kit.read_summary(one_dir)["parameters"]
        # the saved folder (gathered to rank 0 under FSDP2) loads with model.pretrained, as an unsharded run's does
        recipe = kit.load_recipe(self.recipe)
        loaded = [recipe.build_model(kit.compose_config(self.recipe, [f"model.pretrained={run / 'model'}"]).model,
                                     "sdpa").state_dict() for run in (two_dir, one_dir)]
        assert kit.max_weight_difference(*loaded) <= 1e-5
        return out


class EncoderSuite(RecipeSuite):
    """The recipe's encoder and artifacts: measure == encode, labels, errors, the encoding equal to the family's
    transformers processor's, checkpoints, tokenizer asset. (No recipe needs torchvision: one engine test checks
    them all in one interpreter, ``tests/test_encoder_checks.py``.)

    ``hf_processor(encoder)`` (every recipe defines it) gives the family's transformers processor, built locally
    with ``kit.transformers_processor``; ``encoder_only_fields`` names the media fields the encoder adds that the
    processor does not return; ``video_not_compared`` says why clips cannot go through the family's processor (the
    measured difference), for an encoder that takes video; empty: they do."""

    covers = ("encoder == processor",)  # what it tests on its recipe (testkit.coverage)

    encoder_only_fields: tuple[str, ...] = ()
    video_not_compared: str = ""

    @pytest.fixture(scope="class")
    @classmethod
    def encoder(cls):
        recipe = kit.load_recipe(cls.recipe)
        return recipe.build_encoder(recipe.build_processor(kit.compose_config(cls.recipe).model))

    @classmethod
    def hf_processor(cls, encoder):
        """The family's transformers processor over ``encoder``'s tokenizer, image processor and template, with the
        model config's settings: ``kit.transformers_processor(<its class>, encoder, **settings)``."""
        raise NotImplementedError(f"{cls.__name__}: define hf_processor(encoder), the family's transformers processor")

    def test_measure_equals_encode_on_many_records(self, encoder, tmp_path):
        assert kit.check_measure_equals_encode(encoder, tmp_path) > 20

    def test_labels_supervise_only_assistant_turns(self, encoder, tmp_path):
        records = kit.demo_like_records(tmp_path)
        kit.check_assistant_only_labels(encoder, records, [encoder.encode(r) for r in records])

    def test_bad_records_name_their_origin(self, encoder, tmp_path):
        kit.check_bad_records_name_origin(encoder, tmp_path)

    def test_encoding_equals_the_family_transformers_processor(self, encoder, tmp_path):
        """One image, three images over two turns with a system turn, text-only records and, for an encoder that
        takes video, clips of several containers and rates (alone, together, beside an image): ids, token types
        and every field the processor returns are the encoder's."""
        records = kit.demo_like_records(tmp_path)
        assert {len(r.image_paths) for r in records} == {0, 1, 3}
        if encoder.video_token and not self.video_not_compared:
            records += kit.varied_video_records(tmp_path / "videos")
        comparison = kit.check_encoder_matches_processor(encoder, self.hf_processor(encoder), records)
        print(comparison.line())
        if self.video_not_compared:
            print(f"clips not compared: {self.video_not_compared}")
        assert comparison.encoder_only == set(self.encoder_only_fields)
        compares_clips = any("video_grid_thw" in fields or "pixel_values_videos" in fields
                             for fields in comparison.fields.values())
        assert compares_clips == bool(encoder.video_token and not self.video_not_compared)

    def test_the_processor_comparison_sees_one_image_token_too_many(self, encoder, tmp_path):
        """The comparison can fail: this recipe's encoder giving its first image one placeholder more (text and
        count agreeing, as in a wrong count hook) differs from the family's processor built over it."""

        class OneTokenMore(type(encoder)):
            def encode_images(self, images):
                media, counts = super().encode_images(images)
                return media, [counts[0] + 1, *counts[1:]]

        broken = OneTokenMore(encoder.processor)
        record = kit.demo_like_records(tmp_path)[0]
        assert len(record.image_paths) == 1
        assert broken.encode(record).length == encoder.encode(record).length + 1
        with pytest.raises(AssertionError, match="first difference"):
            kit.check_encoder_matches_processor(broken, self.hf_processor(broken), [record])

    def test_save_load_round_trip(self, tmp_path):
        kit.check_save_load_round_trip(self.recipe, tmp_path)

    def test_tokenizer_asset_is_reproducible(self, tmp_path):
        kit.check_tokenizer_asset(self.recipe, tmp_path)


class ContextParallelSuite(RecipeSuite):
    """Context parallelism, exact: a whole packed row split over 2 gloo ranks (the cut inside an image's
    placeholder run) gives the unsplit logits, loss and gradients on every CPU backend the recipe declares (flex:
    forward only); CP = 2 on 2 processes trains what 1 process trains (loss per step, final weights), counting each
    row once (the engine's own tests run DP 2 x CP 2 on 4 processes: the mesh is the engine's, not a recipe's)."""

    covers = ("CP", "DDP")  # what it tests on its recipe (testkit.coverage)
    overrides: tuple[str, ...] = ()  # more keys of both training runs (a MoE recipe: its load-balancing loss on)

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tmp_path_factory):
        return shared_case(cls.recipe, tmp_path_factory)

    @pytest.mark.launch
    def test_split_row_equals_unsplit_on_every_backend(self, case, tmp_path):
        backends = [b for b in case.recipe.attention_backends if not BACKENDS[b].package]  # flash needs CUDA
        reports = kit.check_split_row_equivalence(case, backends, tmp_path)
        print("\n".join(r.line() for r in reports))
        for report in reports:
            assert report.max_logit_diff <= kit.TOL and report.loss_diff <= kit.TOL, report.line()
            assert report.grad_rel_diff is None or report.grad_rel_diff <= kit.TOL, report.line()

    @pytest.mark.slow
    @pytest.mark.launch
    def test_cp2_trains_what_one_process_trains(self, tmp_path):
        line = kit.check_split_training(self.recipe, tmp_path, split=(2, 2), reference=(1, 1),
                                        overrides=self.overrides)
        print(line)
