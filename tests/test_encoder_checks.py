"""Encoder checks over every recipe at once: no recipe needs torchvision.

Why one engine test: the check needs a fresh interpreter (torchvision made unimportable before anything imports),
and an interpreter's start-up and imports cost more than the check itself; one interpreter goes through every recipe
(encode an image record, a forward) and names each that fails. Each recipe's own encoder checks are its
``EncoderSuite`` (``recipes/<name>/tests/test_encoder.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mvp_engine.engine.testing import check_no_torchvision

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.parent.name for p in (REPO_ROOT / "recipes").glob("*/train.py"))


@pytest.mark.launch
def test_no_recipe_needs_torchvision(tmp_path):
    assert len(RECIPES) >= 9
    check_no_torchvision(RECIPES, tmp_path)
