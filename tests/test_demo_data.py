"""The embedded demo data set: reproducible to the byte, readable, mixed like real VLM SFT data, and written by an
entry point only (``with_demo_data``), never by building a ``Trainer``."""

from __future__ import annotations

import json
import runpy
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

import mvp_engine.engine.testing as kit
from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.demo import JSONL_NAME, MANIFEST_NAME, demo_kind_counts, with_demo_data, write_demo_dataset
from mvp_engine.engine.trainer import Trainer
from mvp_engine.kit.mllm.data import MLLMDataKit
from mvp_engine.kit.mllm.data.images import read_image_size
from mvp_engine.kit.mllm.data.sources import read_records

NUM = 150  # enough for every kind (overlong included) while keeping the tests fast


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), num_samples=NUM, seed=0)


def test_same_seed_gives_byte_identical_files_and_another_seed_does_not(demo: Path, tmp_path: Path) -> None:
    again = write_demo_dataset(tmp_path / "again", num_samples=NUM, seed=0)
    assert snapshot(again.parent) == snapshot(demo.parent)
    other = write_demo_dataset(tmp_path / "other", num_samples=NUM, seed=1)
    assert other.read_bytes() != demo.read_bytes()
    assert not any(tmp.name.endswith(".tmp") for tmp in again.parent.rglob("*"))


def test_repeated_call_is_a_no_op_and_changed_arguments_regenerate(tmp_path: Path) -> None:
    path = write_demo_dataset(tmp_path, num_samples=20, seed=3)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert write_demo_dataset(tmp_path, num_samples=20, seed=3) == path
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == stamps

    write_demo_dataset(tmp_path, num_samples=10, seed=3)  # smaller: stale images of the larger one go away
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["num_samples"] == 10
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "images").iterdir()) == manifest["images"]
    assert len(list(read_records(path))) == 10

    (tmp_path / manifest["images"][0]).unlink()  # incomplete directory: regenerated, not trusted
    write_demo_dataset(tmp_path, num_samples=10, seed=3)
    assert (tmp_path / manifest["images"][0]).is_file()


def test_records_parse_and_the_mix_has_every_kind(demo: Path) -> None:
    records = list(read_records(demo))
    assert len(records) == NUM
    assert len({r.record_id for r in records}) == NUM
    images = [len(r.image_paths) for r in records]
    turns = [sum(m["role"] == "assistant" for m in r.messages) for r in records]
    words = [
        sum(len(p["text"].split()) for m in r.messages for p in m["content"] if p["type"] == "text") for r in records
    ]
    counts = demo_kind_counts(NUM)
    assert images.count(0) == counts["text_only"]
    assert sum(n > 1 for n in images) == counts["multi_image"]
    assert any(t > 1 and n == 1 for t, n in zip(turns, images, strict=True))  # multi-turn with an image
    # Overlong by text alone: more words than 2048 means more than 2048 tokens under any tokenizer.
    assert sum(w > 2048 for w in words) == counts["overlong"] >= 1
    # Long tail: most samples short.
    assert sorted(words)[len(words) // 2] < 40
    assert any(r.messages[0]["role"] == "system" for r in records)


def test_kind_counts_for_the_default_size() -> None:
    counts = demo_kind_counts(600)
    assert sum(counts.values()) == 600
    assert counts == {
        "multi_turn": 120,
        "describe": 42,
        "text_only": 60,
        "multi_image": 60,
        "overlong": 6,
        "single": 312,
    }
    assert sum(demo_kind_counts(3).values()) == 3


def test_header_size_equals_decoded_size_and_sizes_vary(demo: Path) -> None:
    sizes = set()
    for record in read_records(demo):
        for path in record.image_paths:
            with Image.open(path) as image:
                image.load()
                assert read_image_size(path) == image.size
                sizes.add(image.size)
    widths, heights = {w for w, _ in sizes}, {h for _, h in sizes}
    assert min(widths | heights) >= 56 and max(widths | heights) <= 448
    assert any(w != h for w, h in sizes) and any(w == h for w, h in sizes)
    assert len(sizes) > 50


def test_cli_writes_the_dataset(tmp_path: Path, monkeypatch, capsys) -> None:
    """``python -m mvp_engine.engine.demo`` as that command runs it (``__main__``, the arguments on ``sys.argv``), in
    this process: a fresh interpreter cost 10-15 s of imports, and the command line, not the process, is checked."""
    monkeypatch.setattr(sys, "argv", ["mvp_engine.engine.demo", "--out", str(tmp_path), "--num-samples", "12",
                                      "--seed", "5"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mvp_engine.engine.demo", run_name="__main__")
    assert exit_.value.code == 0
    assert str(tmp_path / "demo.jsonl") in capsys.readouterr().out
    assert len(list(read_records(tmp_path / "demo.jsonl"))) == 12


def test_videos_add_reproducible_clips_that_decode_as_their_headers_say(tmp_path: Path) -> None:
    """``videos=True``: ~5% LLaVA-Video records with H.264 clips, byte-identical for a seed, each decoding to the
    frame count its header states; the same folder asked again without videos is regenerated without them."""
    import av

    from mvp_engine.kit.mllm.data.video import read_video_info

    path = write_demo_dataset(tmp_path / "a", num_samples=40, seed=0, videos=True)
    assert snapshot(path.parent) == snapshot(write_demo_dataset(tmp_path / "b", 40, 0, videos=True).parent)
    clips = [clip for record in read_records(path) for clip in record.video_paths]
    assert len(clips) == demo_kind_counts(40, videos=True)["video"] == 2
    assert sorted(str(Path(c).relative_to(path.parent)) for c in clips) == \
        json.loads((path.parent / MANIFEST_NAME).read_text())["videos"]
    for clip in clips:
        info = read_video_info(clip)
        with av.open(clip) as container:
            assert sum(1 for _ in container.decode(video=0)) == info.num_frames >= 8
    write_demo_dataset(tmp_path / "a", num_samples=40, seed=0)
    assert "videos" not in json.loads((path.parent / MANIFEST_NAME).read_text())
    assert not list((path.parent / "videos").glob("*.mp4"))
    assert not any(record.video_paths for record in read_records(path))


def test_with_demo_data_fills_only_empty_sources_of_an_enabled_demo(tmp_path: Path) -> None:
    demo = [f"demo.out_dir={tmp_path / 'demo'}", "demo.num_samples=12"]
    cfg = kit.compose_config("llava", demo)
    filled = with_demo_data(cfg)
    assert list(filled.data.sources) == [str(tmp_path / "demo" / "12_seed0" / JSONL_NAME)]
    assert list(cfg.data.sources) == []  # a copy: the caller's config is left as it was
    assert len(list(read_records(filled.data.sources[0]))) == 12
    named = kit.compose_config("llava", [*demo, f"data.sources=[{filled.data.sources[0]}]"])
    assert with_demo_data(named) is named
    disabled = kit.compose_config("llava", ["demo.enabled=false", f"demo.out_dir={tmp_path / 'off'}"])
    assert with_demo_data(disabled) is disabled and not (tmp_path / "off").exists()


def test_demo_sets_of_other_settings_live_apart_and_leave_each_other_alone(tmp_path: Path) -> None:
    """Two runs with different ``demo.num_samples`` once shared ``demo.out_dir`` and rewrote each other's set (one
    could read the other's half-written files)."""
    sources = {n: with_demo_data(kit.compose_config("llava", [f"demo.out_dir={tmp_path}", f"demo.num_samples={n}"]))
               .data.sources[0] for n in (8, 9)}
    first = snapshot(Path(sources[8]).parent)
    assert with_demo_data(kit.compose_config("llava", [f"demo.out_dir={tmp_path}", "demo.num_samples=9",
                                                        "demo.seed=1"])).data.sources[0] not in sources.values()
    assert snapshot(Path(sources[8]).parent) == first
    assert {n: len(list(read_records(path))) for n, path in sources.items()} == {8: 8, 9: 9}


def test_building_a_trainer_writes_no_file_and_without_sources_it_says_what_to_do(tmp_path: Path) -> None:
    run = [f"demo.out_dir={tmp_path / 'demo'}", "demo.num_samples=12", f"train.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"^data.sources is empty: .*with_demo_data\(cfg\)"):
        Trainer(kit.compose_config("llava", run), kit.load_recipe("llava"))
    assert not (tmp_path / "demo").exists()
    cfg = with_demo_data(kit.compose_config("llava", run))
    written = snapshot(tmp_path)
    Trainer(cfg, kit.load_recipe("llava"))
    assert snapshot(tmp_path) == written and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["gemma3", "gemma4", "internvl"])
def test_a_recipe_demo_drops_no_sample_but_those_made_overlong(name: str) -> None:
    """The demo fits the recipe it demonstrates: its default packed run, planned from metadata (no model, no pixel),
    drops no sample as overlong but the demo's ~1% records made to be (> 5,000 tokens). These recipes set
    ``data.max_seq_len`` for it; at ``conf/data/demo.yaml``'s 1024 the demo's long descriptions (1,000-2,200 tokens)
    dropped too, 12-13 samples an epoch."""
    recipe = kit.load_recipe(name)
    cfg = with_demo_data(kit.compose_config(name, ["+packing=greedy"]))
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    dataset = MLLMDataKit.build_dataset(specs.data, recipe.build_encoder(recipe.build_processor(cfg.model)))
    made_overlong = demo_kind_counts(cfg.demo.num_samples, cfg.demo.videos)["overlong"]
    assert dataset.plan(0).drop_counts == Counter(overlong=made_overlong)
