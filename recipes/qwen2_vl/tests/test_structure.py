"""The qwen2_vl recipe has its parts, and every packing x attention combination composes and validates."""

import subprocess
import sys

from mvp_engine.engine.testing import check_all_combinations_compose, check_structure


def test_recipe_has_entry_point_encoder_and_prepare_packed():
    check_structure("qwen2_vl")


def test_every_packing_and_attention_combination_composes():
    assert check_all_combinations_compose("qwen2_vl") == 3 * 5


def test_bad_config_stops_with_one_line_naming_the_key(tmp_path):
    cmd = [sys.executable, "-m", "recipes.qwen2_vl.train", "+packing=greedy", "packing.strategy=zigzag",
           f"train.output_dir={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("config error: packing.strategy='zigzag' is invalid"), result.stderr
    assert "Traceback" not in result.stderr
