"""Every source kind the README names trains and is checked the DataKit's way: JSON, JSONL, parquet, ``save_to_disk``
folders and a mix of them in one ``data.sources`` list.

The same six records (images and text only) written as each kind train exactly what the JSONL trains: the same
samples, the same tokens, the same losses. ``tools/check_data.py`` reads each kind through the record store and names
a bad record by its origin: ``file:line``, ``file#row``, ``folder#row``. A path that is no source stops the config
check with one line naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.trainer import Trainer
from mvp_engine.kit.mllm.data import MLLMDataSpec, find_bad_records, source_kind
from tests.fakes import FakeEncoder
from tools.check_data import check_records

RECIPE = "llava"
NUM_RECORDS = 6
CHECK_TOOL = kit.CONF_DIR.parent / "tools" / "check_data.py"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """The folder of the rows' images: each source below lies elsewhere, so runs name it as ``data.image_root``."""
    return tmp_path_factory.mktemp("rows")


@pytest.fixture(scope="module")
def rows(images) -> list[dict]:
    """LLaVA records alternating image and text only, one schema for all (as a parquet or Arrow table has)."""
    jsonl = kit.write_mixed_jsonl(images, num_records=NUM_RECORDS)
    return [{"image": None, **json.loads(line)} for line in jsonl.read_text().splitlines()]


def write_source(kind: str, path: Path, rows: list[dict]) -> Path:
    """``rows`` as a source of ``kind`` at ``path`` (a suffix is added for a file)."""
    if kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "json":
        path = path.with_suffix(".json")
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "parquet":
        path = path.with_suffix(".parquet")
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def train(sources: list[Path], out: Path, images: Path) -> dict:
    cfg = kit.compose_config(RECIPE, ["+packing=greedy", f"data.sources=[{','.join(map(str, sources))}]",
                                      f"data.image_root={images}", "data.max_seq_len=256", "train.epochs=1",
                                      "train.micro_batch_size=3", f"train.output_dir={out}"])
    trainer = Trainer(cfg, kit.load_recipe(RECIPE))
    summary = trainer.run()
    summary["record_ids"] = [trainer.dataset.records[i].record_id for i in range(len(trainer.dataset.records))]
    return summary


@pytest.fixture(scope="module")
def reference(rows, images, tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("reference")
    return train([write_source("jsonl", directory / "data", rows)], directory / "run", images)


@pytest.mark.parametrize("kinds", [("parquet",), ("saved",), ("json", "parquet", "saved")],
                         ids=["parquet", "save_to_disk", "mixed"])
def test_every_source_kind_trains_the_records_it_holds(rows, images, reference, tmp_path, kinds):
    parts = [rows[k * NUM_RECORDS // len(kinds):(k + 1) * NUM_RECORDS // len(kinds)] for k in range(len(kinds))]
    sources = [write_source(kind, tmp_path / f"part{k}", part) for k, (kind, part) in enumerate(zip(kinds, parts))]
    summary = train(sources, tmp_path / "run", images)
    assert summary["record_ids"] == [row["id"] for row in rows] == reference["record_ids"]
    [ledger] = summary["epochs"]
    assert ledger["samples_trained"] == NUM_RECORDS and ledger["reconciles"] and not ledger["bad"]
    assert summary["actual_steps"] == reference["actual_steps"] > 0 and summary["totals"] == reference["totals"]
    assert summary["losses"] == reference["losses"]


def no_source(kind: str, directory: Path) -> Path:
    """A path that is no source: ``absent``, a ``plain`` folder, a ``csv`` file."""
    path = directory / {"absent": "absent", "plain": "plain", "csv": "data.csv"}[kind]
    if kind == "plain":
        path.mkdir()
    elif kind == "csv":
        path.write_text("x")
    return path


@pytest.mark.parametrize("kind,message", [
    ("absent", "data source not found"), ("plain", "a folder source must be written by datasets' save_to_disk"),
    ("csv", "unsupported source '.csv'"),
])
def test_a_path_that_is_no_source_is_one_config_line_naming_it(tmp_path, kind, message):
    path = no_source(kind, tmp_path)
    cfg = kit.compose_config(RECIPE, [f"data.sources=[{path}]"])
    with pytest.raises(ConfigError, match=f"^data.sources: {path}: {message}"):
        resolve_run_specs(cfg, kit.load_recipe(RECIPE).attention_backends)


def test_a_dataset_dict_folder_is_read_by_its_train_split(tmp_path):
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "3 0"}, {"from": "gpt", "value": "ok"}]}
            for i in range(3)]  # FakeEncoder reads "length media" from the first turn
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(folder))
    assert source_kind(folder) == "saved"
    report = find_bad_records(MLLMDataSpec(sources=[str(folder)], cache_dir=str(tmp_path / "cache")), FakeEncoder())
    assert (report.records_read, report.count) == (3, 0)


def with_bad_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with row 2 missing its image and row 5 opening with an assistant turn."""
    bad = [dict(row) for row in rows]
    bad[1] = {**bad[1], "image": "images/absent.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "No idea."}]}
    answer = bad[4]["conversations"][-1]
    bad[4] = {**bad[4], "conversations": [answer, *bad[4]["conversations"]]}
    return bad


@pytest.mark.parametrize("kind", ["parquet", "saved"], ids=["parquet", "save_to_disk"])
def test_check_data_names_a_bad_row_by_its_source_and_row(rows, images, tmp_path, kind):
    source = write_source(kind, tmp_path / "data", with_bad_rows(rows))
    cfg = kit.compose_config(RECIPE, [f"data.sources=[{source}]", f"data.image_root={images}"])
    report = check_records(cfg, RECIPE, decode=True, workers=2)
    assert {bad.origin: (bad.reason, bad.stage) for bad in report.records.values()} == {
        f"{source}#2": ("missing_image", "read"), f"{source}#5": ("leading_assistant", "read")}
    assert report.records_read == NUM_RECORDS


@pytest.mark.launch
def test_check_data_cli_on_a_mix_with_decode_names_every_bad_record_and_exits_1(rows, images, tmp_path):
    bad_rows = with_bad_rows(rows)
    jsonl = write_source("jsonl", tmp_path / "lines", bad_rows[:3])
    saved = write_source("saved", tmp_path / "saved", bad_rows[3:])
    cut = tmp_path / "cut.png"
    kit.write_image(cut, 64, 64, 7)
    cut.write_bytes(cut.read_bytes()[:300])  # a header that reads, a body that does not decode
    parquet = write_source("parquet", tmp_path / "table", [{**rows[0], "id": "cut", "image": str(cut)}])
    result = subprocess.run([sys.executable, str(CHECK_TOOL), "--config-name", RECIPE, "--decode",
                             f"data.sources=[{jsonl},{saved},{parquet}]", f"data.image_root={images}",
                             f"hydra.run.dir={tmp_path / 'check'}"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    report = {bad["origin"]: (bad["reason"], bad["stage"])
              for bad in map(json.loads, (tmp_path / "check" / "bad_records.jsonl").read_text().splitlines())}
    assert report == {f"{jsonl}:2": ("missing_image", "read"), f"{saved}#2": ("leading_assistant", "read"),
                      f"{parquet}#1": ("corrupt_image", "decode")}
    assert f"{NUM_RECORDS + 1} records read, 3 bad" in result.stdout and "Traceback" not in result.stderr
