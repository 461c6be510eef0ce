"""Training on messy data: a third of 300 records broken in every way such data breaks, found and reported at once.

The mix (``write_messy_jsonl``) carries one fault class per broken record, including a corrupt image body that only
decoding finds. Under the defaults the run stops with one line naming the bad fraction and the report; with
``data.max_bad_fraction=0.5`` it trains to the end with every broken record reported and the totals reconciling;
``tools/check_data.py --decode`` lists them all in one run; on 2 processes a decoding fault mid-epoch keeps the
ranks in step under ``skip`` and stops every rank together under ``error``.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
from PIL import Image

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.records import write_messy_jsonl
from mvp_engine.engine.trainer import Trainer
from mvp_engine.kit.mllm.data import MLLMRecord, MLLMRecordError

RECIPE = "qwen2_vl"
DECODE_STAGE = {"corrupt_image"}
MEASURE_STAGE = {"unreadable_image"}
CHECK_TOOL = kit.CONF_DIR.parent / "tools" / "check_data.py"


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    return write_messy_jsonl(tmp_path_factory.mktemp("messy"), num_records=300)


def overrides(data: Path, *extra: str) -> list[str]:
    return ["+packing=greedy", f"data.sources=[{data}]", "train.epochs=2", "train.micro_batch_size=4", *extra]


def read_report(path: Path) -> dict[str, dict]:
    return {bad["origin"]: bad for bad in map(json.loads, path.read_text().splitlines())}


def test_a_third_broken_stops_under_the_defaults_with_one_line(messy, tmp_path):
    data, expected = messy
    result = kit.train(RECIPE, tmp_path, overrides(data), check=False)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    known = {origin: reason for origin, reason in expected.items() if reason not in DECODE_STAGE}
    assert last.startswith(f"data error: {len(known)} of 300 records are bad ({len(known) / 300:.1%} > "
                           "data.max_bad_fraction=0.01)"), result.stderr[-2000:]
    assert str(tmp_path / "bad_records.jsonl") in last and "Traceback" not in result.stderr
    report = read_report(tmp_path / "bad_records.jsonl")
    assert {origin: bad["reason"] for origin, bad in report.items()} == known


@pytest.mark.parametrize("recipe", ["qwen2_vl", "llava"])
def test_with_half_allowed_it_trains_to_the_end_and_every_record_is_accounted_for(messy, tmp_path, recipe):
    data, expected = messy
    cfg = kit.compose_config(recipe, [*overrides(data, "data.max_bad_fraction=0.5"), f"train.output_dir={tmp_path}"])
    summary = Trainer(cfg, kit.load_recipe(recipe)).run()
    assert summary["actual_steps"] == summary["estimated_steps"]
    report = read_report(tmp_path / "bad_records.jsonl")
    assert {origin: bad["reason"] for origin, bad in report.items()} == expected
    for origin, bad in report.items():
        stage = "decode" if bad["reason"] in DECODE_STAGE else "measure" if bad["reason"] in MEASURE_STAGE else "read"
        assert bad["stage"] == stage and bad["message"].startswith(origin)
    assert summary["records"]["bad_total"] == len(expected) and summary["records"]["read"] == 300
    for ledger in summary["epochs"]:
        assert ledger["reconciles"], ledger
        assert sum(ledger["bad"].values()) == len(expected)
        assert ledger["samples_trained"] + sum(ledger["dropped"].values()) == 300 - len(expected)
    assert sum(e["samples_trained"] for e in summary["epochs"]) == summary["totals"]["samples"]


def test_check_data_lists_every_bad_record_in_one_run(messy, tmp_path, monkeypatch, capsys):
    """``tools/check_data.py --decode`` with 2 workers, run as its command runs it (``__main__``, the arguments on
    ``sys.argv``) in this process, its exit status the ``SystemExit`` it raises: a fresh interpreter cost 10-15 s of
    imports (the command in its own process: ``tests/test_source_kinds.py``)."""
    data, expected = messy
    monkeypatch.setattr(sys, "argv", ["tools/check_data.py", "--decode", f"data.sources=[{data}]",
                                      f"hydra.run.dir={tmp_path}", "+check.workers=2"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(CHECK_TOOL), run_name="__main__")
    stdout, stderr = capsys.readouterr()
    assert exit_.value.code == 1, stderr[-2000:]
    report = read_report(tmp_path / "bad_records.jsonl")
    assert {origin: bad["reason"] for origin, bad in report.items()} == expected
    assert f"300 records read, {len(expected)} bad" in stdout
    for reason in set(expected.values()):
        assert f" {reason} " in stdout


def test_the_qwen2_vl_processor_refusing_an_image_is_a_bad_record_not_a_crash(tmp_path):
    """Qwen2-VL's image processor refuses aspect ratios of 200 and more (e.g. 4000 x 16)."""
    recipe = kit.load_recipe(RECIPE)
    encoder = recipe.build_encoder(recipe.build_processor(kit.compose_config(RECIPE).model))
    Image.new("RGB", (4000, 16), (10, 20, 30)).save(tmp_path / "strip.png")
    record = MLLMRecord("strip", "strips.jsonl:7", [kit.user(kit.image(str(tmp_path / "strip.png")), kit.text("?")),
                                                    kit.assistant("A strip.")])
    with pytest.raises(MLLMRecordError, match=r"^strips.jsonl:7: .*refused by the image processor") as err:
        encoder.measure(record)
    assert err.value.reason == "image_rejected" and err.value.record_id == "strip"


@pytest.fixture(scope="module")
def one_corrupt(tmp_path_factory) -> Path:
    """The alternating image / text-only mix with one corrupt image body in the middle."""
    directory = tmp_path_factory.mktemp("one_corrupt")
    data = kit.write_mixed_jsonl(directory, num_records=11)
    lines = data.read_text().splitlines()
    record = json.loads(lines[4])
    cut = directory / "cut.png"
    kit.write_image(cut, 64, 64, 7)
    cut.write_bytes(cut.read_bytes()[:300])
    record["image"] = str(cut)
    lines[4] = json.dumps(record)
    data.write_text("\n".join(lines) + "\n")
    return data


def corrupt_overrides(data: Path, *extra: str) -> list[str]:
    return [f"data.sources=[{data}]", "data.shuffle=false", "data.max_seq_len=160", "train.epochs=1",
            "train.micro_batch_size=1", *extra]


@pytest.mark.slow
def test_a_corrupt_body_mid_epoch_on_two_ranks_is_left_out_and_the_ranks_stay_in_step(one_corrupt, tmp_path):
    # DataLoader workers decode here: the fault travels to the trainer inside the batch
    kit.train(RECIPE, tmp_path, corrupt_overrides(one_corrupt, "data.max_bad_fraction=0.5", "train.num_workers=2"),
             nproc=2)
    summary = kit.read_summary(tmp_path)
    assert summary["steps_per_rank_this_session"] == [summary["estimated_steps"]] * 2
    [ledger] = summary["epochs"]
    assert ledger["bad"] == {"corrupt_image": 1} and ledger["samples_trained"] == 10 and ledger["reconciles"]
    [bad] = read_report(tmp_path / "bad_records.jsonl").values()
    assert bad["origin"].endswith(":5") and bad["stage"] == "decode"


@pytest.mark.launch
@pytest.mark.slow
def test_under_error_a_corrupt_body_stops_both_ranks_together_with_one_line(one_corrupt, tmp_path):
    result = kit.train(RECIPE, tmp_path, corrupt_overrides(one_corrupt, "data.on_bad_record=error"), nproc=2,
                      timeout=240, check=False)
    assert result.returncode != 0
    # (rank 0's line may follow its progress bar on the same terminal line)
    stops = [line for line in result.stderr.splitlines() if "data error: data.on_bad_record=error" in line]
    assert len(stops) == 2, result.stderr[-3000:]  # each rank, at the same step; none left in a collective
    assert ":5: record 'image4'" in stops[0] and "corrupt_image" in stops[0]
