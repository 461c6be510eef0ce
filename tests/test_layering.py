"""The model-free layers stay model-free: no module under ``mvp_engine/`` imports a recipe, imports a model family's
transformers module or class, names a function, class or module after a family, or holds a family's name in a string
of its code (a class-name allow-list: data the next family would have to edit) (``../shared/DESIGN.md``, Layering).
What several recipes of one family share lives in a family package under ``recipes/`` (``recipes/qwen``).

Why a test: imports pointing left are easy to keep, meaning is not; one ``qwen.py`` in the engine is how the next
family's code would follow it there. Docstrings and comments may name families (as examples, or where measured).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_FREE = REPO_ROOT / "mvp_engine"
FAMILY = re.compile(r"qwen|llava|gemma|internvl|glm|deltanet", re.IGNORECASE)
GENERIC_TRANSFORMERS_MODELS = {"auto"}  # transformers.models.auto reads any config: not a family
# (module, name) pairs that name a family on purpose: a defined name, or the family's word in a string
ALLOWED_NAMES = {
    # "LLaVA style" is a record format (``conversations`` with ``from`` / ``value``), not the model
    ("mvp_engine/kit/mllm/data/sources.py", "_llava_messages"),
    ("mvp_engine/kit/mllm/data/sources.py", "LLaVA"),
    ("mvp_engine/engine/demo/__main__.py", "LLaVA"),  # the demo data set is written in that record format
}


def modules() -> list[Path]:
    return sorted(MODEL_FREE.rglob("*.py"))


def imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "transformers.models":  # from transformers.models import <family>
            return [f"{node.module}.{alias.name}" for alias in node.names]
        return [node.module]
    return []


def documentation(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are statements of their own: docstrings (and bare strings), not code."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def family_violations(where: str, source: str) -> list[str]:
    """What the module at ``where`` (its path in the repository) ties to a model family, one line each."""
    found = [f"{where}: module named after a family"] if FAMILY.search(Path(where).stem) else []
    tree = ast.parse(source, filename=where)
    docs = documentation(tree)
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        for module in imported_modules(node):
            parts = module.split(".")
            if parts[0] == "recipes":
                found.append(f"{line}: imports {module} (a recipe)")
            elif parts[:2] == ["transformers", "models"] and len(parts) > 2 \
                    and parts[2] not in GENERIC_TRANSFORMERS_MODELS:
                found.append(f"{line}: imports {module} (a model family's transformers module)")
        if isinstance(node, ast.ImportFrom):
            found += [f"{line}: imports {alias.name}" for alias in node.names if FAMILY.search(alias.name)]
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and FAMILY.search(node.name) \
                and (where, node.name) not in ALLOWED_NAMES:
            found.append(f"{line}: defines {node.name}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and any((where, m.group()) not in ALLOWED_NAMES for m in FAMILY.finditer(node.value)):
            found.append(f"{line}: names a family in the string {node.value!r}")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(MODEL_FREE).as_posix())
def test_model_free_layers_name_no_model_family(path):
    assert family_violations(path.relative_to(REPO_ROOT).as_posix(), path.read_text()) == []


def test_the_check_catches_what_it_names():
    """Every kind of violation is reported, one line each (the old ``mvp_engine/engine/qwen.py`` had most; the old
    ``packing/linear_attention.py`` held the class-name list and the suffix); docstrings and comments are not code."""
    source = ('"""Docstrings may name Qwen2-VL."""\n'
              "from transformers import Qwen2VLConfig\n"
              "from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize\n"
              "import recipes.qwen2_vl\n"
              "class QwenBundle: ...\n"
              "def build_qwen_model(): ...\n"
              'SUPPORTED = ("Qwen3_5GatedDeltaNet",)  # comments may name Gemma\n'
              'def refuse(name): raise ValueError(f"{name} is no GatedDeltaNet")\n')
    found = family_violations("mvp_engine/engine/qwen.py", source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "module named after a family",
        "imports Qwen2VLConfig",
        "imports transformers.models.qwen2_vl.image_processing_pil_qwen2_vl (a model family's transformers module)",
        "imports recipes.qwen2_vl (a recipe)",
        "defines QwenBundle",
        "defines build_qwen_model",
        "names a family in the string 'Qwen3_5GatedDeltaNet'",
        "names a family in the string ' is no GatedDeltaNet'",
    ]
    hint = 'HINT = "neither LLaVA style nor OpenAI style"\n'  # an allowed word, in its own module only
    assert family_violations("mvp_engine/kit/mllm/data/sources.py", hint) == []
    assert family_violations("mvp_engine/kit/mllm/data/spec.py", hint) == [
        "mvp_engine/kit/mllm/data/spec.py:1: names a family in the string 'neither LLaVA style nor OpenAI style'"]


# --- imports point left; tools are thin command lines --------------------------------------------------------------

# kit <- packing <- engine <- recipes <- tools: a module imports only its own layer and those to its left
LAYERS = ("mvp_engine.kit", "mvp_engine.packing", "mvp_engine.engine", "recipes", "tools")
LAYERED_ROOTS = ("mvp_engine", "recipes", "tools")


def layer_of(module: str) -> int | None:
    return next((rank for rank, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")), None)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute_imports(where: str, source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the module named ``where``, relative ones resolved."""
    package = where if where.endswith("__init__") else where.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names = [alias.name for alias in node.names] if not node.module else [None]  # from . import a, b
            found += [(node.lineno, module if name is None else f"{module}.{name}") for name in names]
    return found


def layering_violations(where: str, source: str) -> list[str]:
    """Imports of ``where`` that point right (into a higher layer), or from one tool into another."""
    own = layer_of(where)
    found = []
    for line, module in absolute_imports(where, source):
        target = layer_of(module)
        if target is not None and own is not None and target > own:
            found.append(f"{where}:{line}: imports {module} (layer {LAYERS[target]} is above {LAYERS[own]})")
        elif target == own == LAYERS.index("tools"):
            found.append(f"{where}:{line}: imports {module} (a tool imports another tool)")
    return found


def layered_modules() -> list[Path]:
    return sorted(p for root in LAYERED_ROOTS for p in (REPO_ROOT / root).rglob("*.py") if "tests" not in p.parts)


@pytest.mark.parametrize("path", layered_modules(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_imports_point_left(path):
    assert layering_violations(module_name(path), path.read_text()) == []


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "tools").glob("*.py")), ids=lambda p: p.name)
def test_a_tool_edits_no_import_path(path):
    """The package is installed (``pip install -e .``): a tool that edits ``sys.path`` hides a missing install."""
    tree = ast.parse(path.read_text())
    edits = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert edits == [], f"{path.name} touches sys.path at lines {edits}"


def test_the_layering_check_catches_what_it_names():
    source = ("from mvp_engine.engine.config import ConfigError\n"
              "from . import cost\n"
              "import recipes.llava\n")
    found = layering_violations("mvp_engine.kit.mllm.data.spec", source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports mvp_engine.engine.config (layer mvp_engine.engine is above mvp_engine.kit)",
        "imports recipes.llava (layer recipes is above mvp_engine.kit)",
    ]
    assert layering_violations("mvp_engine.packing.inputs", "from ..engine import trainer\n") == [
        "mvp_engine.packing.inputs:1: imports mvp_engine.engine (layer mvp_engine.engine is above mvp_engine.packing)"]
    assert layering_violations("tools.estimate_steps", "from tools.pack_report import ReportSpec\n") == [
        "tools.estimate_steps:1: imports tools.pack_report (a tool imports another tool)"]
    assert layering_violations("recipes.qwen2_vl.model", "from recipes.qwen import build_qwen_model\n") == []


# --- a recipe shares code with another family only through a generic layer -----------------------------------------

# (importing family, imported family package): a recipe built on another family's parts on purpose, and why
CROSS_FAMILY = {
    ("internvl", "qwen"): "InternVL 3's language model is Qwen2's: its tokenizer asset is a Qwen2 BPE (qwen.tokens)",
}


def family_of(package: str) -> str:
    """A recipe package's family: its leading letters (``qwen2_5_vl`` and ``qwen`` -> qwen, ``glm4v_moe`` -> glm)."""
    return re.match(r"[a-z]+", package).group()


def cross_family_imports(where: str, source: str) -> list[str]:
    """Imports by the recipe module named ``where`` of another family's package that :data:`CROSS_FAMILY` does not
    list, one line each: what two families share (GLM-4.1V's grid-patch tower is Qwen2-VL's) lives in a generic
    layer. A package's ``where`` ends in ``__init__``, so its relative imports resolve inside it."""
    own = family_of(where.split(".")[1])
    found = []
    for line, module in absolute_imports(where, source):
        parts = module.split(".")
        if parts[0] == "recipes" and len(parts) > 1 and family_of(parts[1]) != own \
                and (own, family_of(parts[1])) not in CROSS_FAMILY:
            found.append(f"{where}:{line}: imports {module} (another family's package)")
    return found


@pytest.mark.parametrize("path", sorted(p for p in (REPO_ROOT / "recipes").rglob("*.py") if p.parent.name != "recipes"),
                         ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_a_recipe_imports_no_other_familys_package(path):
    where = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    assert cross_family_imports(where, path.read_text()) == []


def test_the_cross_family_check_catches_what_it_names():
    source = "from recipes.qwen import media_kwargs\nfrom recipes.glm4v import packed\nimport recipes.qwen.tokens\n"
    assert cross_family_imports("recipes.glm4v_moe.packed", source) == [
        "recipes.glm4v_moe.packed:1: imports recipes.qwen (another family's package)",
        "recipes.glm4v_moe.packed:3: imports recipes.qwen.tokens (another family's package)"]
    assert cross_family_imports("recipes.internvl.tokens", source) == [  # the listed pair only
        "recipes.internvl.tokens:2: imports recipes.glm4v (another family's package)"]


# --- product code imports no test code -----------------------------------------------------------------------------

TEST_KIT = ("mvp_engine.engine.testkit", "mvp_engine.engine.testing")
# tools whose job is to run the kit's own checks or launches on a recipe, and what they take from it
TEST_KIT_TOOLS = {
    "tools.validate_recipe": "testkit.validate's checks of a recipe's real run",
    "tools.check_packed_equivalence": "testkit.equivalence's packed == one-by-one comparison",
    "tools.bench_balance": "testkit.launch's real training launches and its image writer",
    "tools.gpu_check": "testkit.equivalence's packed == one-by-one comparison and testkit.launch's launches, on CUDA",
}


def kit_imports_of(where: str, source: str) -> list[str]:
    """Imports of the test kit by the module named ``where``, one line each."""
    return [f"{where}:{line}: imports {module} (the test kit)" for line, module in absolute_imports(where, source)
            if any(module == kit or module.startswith(kit + ".") for kit in TEST_KIT)]


def product_modules() -> list[Path]:
    return [p for p in layered_modules() if not any(module_name(p) == kit or module_name(p).startswith(kit + ".")
                                                    for kit in TEST_KIT) and module_name(p) not in TEST_KIT_TOOLS]


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_product_code_imports_no_test_kit(path):
    """``load_recipe``, ``compose_config`` and the specs live in the engine: the trainer, reports and tools run on
    them, never on test code (which may import pytest, spawn processes, or change under the suites' needs)."""
    assert kit_imports_of(module_name(path), path.read_text()) == []


def test_the_test_kit_check_catches_what_it_names():
    source = ("from .testkit.structure import load_recipe\n"
              "from mvp_engine.engine.config import compose_config\n"
              "def main():\n    from mvp_engine.engine.testing import launch\n")
    assert kit_imports_of("mvp_engine.engine.report_config", source) == [
        "mvp_engine.engine.report_config:1: imports mvp_engine.engine.testkit.structure (the test kit)",
        "mvp_engine.engine.report_config:4: imports mvp_engine.engine.testing (the test kit)"]
    assert set(TEST_KIT_TOOLS) <= {module_name(p) for p in layered_modules()}, "a listed tool is gone: drop it"
