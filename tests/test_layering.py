"""The model-free layers stay model-free: no module under ``mvp_engine/`` imports a recipe, imports a model family's
transformers module or class, or names a function, class or module after a family (``../shared/DESIGN.md``,
Layering). What several recipes of one family share lives in a family package under ``recipes/`` (``recipes/qwen``).

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
FAMILY = re.compile(r"qwen|llava|gemma|internvl|glm", re.IGNORECASE)
GENERIC_TRANSFORMERS_MODELS = {"auto"}  # transformers.models.auto reads any config: not a family
# (module, name) pairs that name a family on purpose
ALLOWED_NAMES = {
    # "LLaVA style" is a record format (``conversations`` with ``from`` / ``value``), not the model
    ("mvp_engine/kit/mllm/data/sources.py", "_llava_messages"),
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


def family_violations(where: str, source: str) -> list[str]:
    """What the module at ``where`` (its path in the repository) ties to a model family, one line each."""
    found = [f"{where}: module named after a family"] if FAMILY.search(Path(where).stem) else []
    for node in ast.walk(ast.parse(source, filename=where)):
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
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(MODEL_FREE).as_posix())
def test_model_free_layers_name_no_model_family(path):
    assert family_violations(path.relative_to(REPO_ROOT).as_posix(), path.read_text()) == []


def test_the_check_catches_what_it_names():
    """Every kind of violation is reported, one line each (the old ``mvp_engine/engine/qwen.py`` had most)."""
    source = ("from transformers import Qwen2VLConfig\n"
              "from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize\n"
              "import recipes.qwen2_vl\n"
              "class QwenBundle: ...\n"
              "def build_qwen_model(): ...\n")
    found = family_violations("mvp_engine/engine/qwen.py", source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "module named after a family",
        "imports Qwen2VLConfig",
        "imports transformers.models.qwen2_vl.image_processing_pil_qwen2_vl (a model family's transformers module)",
        "imports recipes.qwen2_vl (a recipe)",
        "defines QwenBundle",
        "defines build_qwen_model",
    ]
