"""``tools/validate_recipe.py``: every soft check passes on qwen2_vl with exit code 0; a recipe whose
``prepare_packed`` lets samples attend to each other (``tests/fixtures/broken_recipe``) fails exactly the
model-preparation check, with exit code 1, while every other check still passes."""

from __future__ import annotations

import re

from mvp_engine.engine.testing import hard_commands
from tools import validate_recipe

SOFT = ["packing-knobs", "custom-assembler", "pack-fields", "collator-padding", "model-preparation", "accounting"]
LINE_RE = re.compile(r"^(PASS|FAIL) ([\w-]+): (.+)$")


def verdicts(stdout: str) -> dict[str, tuple[str, str]]:
    """``{check: (PASS|FAIL, evidence)}`` from the tool's output, in order."""
    return {m.group(2): (m.group(1), m.group(3)) for m in map(LINE_RE.match, stdout.splitlines()) if m}


def test_qwen2_vl_passes_every_soft_check_with_numbers(capsys):
    """The command's ``main`` with its arguments, in this process (a fresh interpreter for it cost ~8 s of
    imports; the other tests here call it the same way)."""
    code = validate_recipe.main(["qwen2_vl"])
    out, err = capsys.readouterr()
    assert code == 0, out + err[-2000:]
    found = verdicts(out)
    assert list(found) == SOFT, out
    assert all(status == "PASS" for status, _ in found.values()), out
    assert "11/11 values equal" in found["packing-knobs"][1]
    assert "NextFitAssembler (group called 1x)" in found["custom-assembler"][1]
    for backend in ("eager", "sdpa"):
        assert re.search(backend + r" \(float32\) max logit diff \d\.\de[-+]\d+ \(0/\d+ segments",
                         found["model-preparation"][1]), found["model-preparation"][1]
    accounting = found["accounting"][1]
    for label in ("samples", "packs", "effective tokens", "total slots", "attention work"):
        counted, planned = re.search(label + r" (\d+) = (\d+)", accounting).groups()
        assert counted == planned
    steps = re.search(r"-> (\d+) optimizer steps .*estimate_total_steps (\d+), Trainer.total_steps (\d+)", accounting)
    assert len(set(steps.groups())) == 1, accounting
    assert out.splitlines()[-1] == f"result: {len(SOFT)}/{len(SOFT)} checks passed"


def test_a_recipe_with_cross_sample_attention_fails_only_model_preparation(capsys):
    code = validate_recipe.main(["llava", "--recipe-module", "tests.fixtures.broken_recipe.train"])
    out = capsys.readouterr().out
    assert code == 1, out
    found = verdicts(out)
    assert list(found) == SOFT, out
    assert [name for name, (status, _) in found.items() if status == "FAIL"] == ["model-preparation"], out
    evidence = found["model-preparation"][1]
    assert re.search(r"sdpa: \d+/\d+ segments, loss, gradients over 1e-05", evidence), evidence
    assert out.splitlines()[-1] == "result: 5/6 checks passed; failed: model-preparation"


def test_hard_checks_are_the_seed_commands():
    commands = {name: command[1:] for name, command in hard_commands("qwen2_vl")}
    assert commands == {
        "compileall": ["-m", "compileall", "-q", "mvp_engine/kit/mllm/data", "recipes/qwen2_vl"],
        "structure-tests": ["-m", "pytest", "recipes/qwen2_vl/tests/test_structure.py", "-q"],
        "smoke-tests": ["-m", "pytest", "recipes/qwen2_vl/tests/test_smoke.py", "-q"],
    }


def test_a_config_error_exits_2_naming_the_key(capsys):
    assert validate_recipe.main(["qwen2_vl", "packing.strategy=zigzag"]) == 2
    assert "packing.strategy='zigzag' is invalid" in capsys.readouterr().err
