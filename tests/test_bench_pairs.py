"""tools/bench_pairs.py on a small demo preference set, in this process: the token counts and the DPO step's three
layouts hold together, whatever the machine's speed.

Checked: each image is encoded once per pair shared and twice duplicated (image tokens exactly 2x), the shared
layout holds fewer tokens per pair and a narrower packed row for the same pairs; the three layouts' step losses
agree to the bench's tolerance (the same pairs, weights and reference), each layout's peak is counted; the OK/MISS
verdicts follow the values. Wall-clock values are never asserted; the printed table is not parsed.
"""

from __future__ import annotations

import math

from tools import bench_pairs as bench


def test_bench_pairs_small_run(tmp_path):
    result = bench.main(["--step-pairs", "3", "--repeats", "1", "--max-pair-tokens", "700",
                         "demo.num_samples=24", f"demo.out_dir={tmp_path}"])
    shared, duplicated = result["tokens"]["shared"], result["tokens"]["duplicated"]
    assert shared["pairs"] == duplicated["pairs"] > 0
    assert duplicated["image_tokens"] == 2 * shared["image_tokens"] > 0
    assert shared["tokens"] < duplicated["tokens"]
    steps = result["steps"]
    assert steps["pairs"] == 3
    rows = steps["layouts"]
    assert rows["shared"]["rows"] == rows["duplicated"]["rows"] == 1 and rows["padded_batch"]["rows"] == 6
    assert rows["pair_by_pair"]["micro_batches"] == 3 and rows["pair_by_pair"]["rows"] == 2
    assert rows["shared"]["width"] < rows["duplicated"]["width"]
    losses = [row["loss"] for row in rows.values()]
    assert all(math.isclose(loss, losses[0], rel_tol=bench.LOSS_TOL) for loss in losses), losses
    assert all(row["peak_bytes"] > 0 and len(row["times_s"]) == 1 for row in rows.values())
    targets = {t["name"]: t for t in result["targets"]}
    assert targets["tokens"]["ok"] == (result["tokens_ratio"] >= bench.TARGET_TOKENS_RATIO)
    assert targets["identical_loss"]["ok"] and targets["identical_loss"]["value"] == steps["loss_diff"]
    assert result["ok"] == all(t["ok"] for t in targets.values())
