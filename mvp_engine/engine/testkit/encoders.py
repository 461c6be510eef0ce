"""Encoder and artifact checks every recipe runs: measure == encode, assistant-only labels, errors naming the
record, save/load round trip, a reproducible tokenizer asset, no torchvision needed."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMMediaHandler, MLLMRecord, MLLMRecordError

from ..config import CONF_DIR
from .equivalence import collate_rows
from .records import assistant, demo_like_records, image, text, user, varied_records, varied_video_records, video_record
from .structure import compose_config, load_recipe

REPO_ROOT = CONF_DIR.parent


def check_measure_equals_encode(encoder, directory: Path) -> int:
    """``measure`` (headers and video metadata only) predicts ``encode`` exactly on many records (clips too when the
    encoder takes video); media rows match their items. A record the processors refuse (Qwen3-VL: a one-frame clip)
    must be refused by both, for the same reason. Returns the records checked (refused ones included)."""
    records = varied_records(Path(directory))
    if encoder.video_token:
        records += varied_video_records(Path(directory) / "videos")
    placeholder_ids = torch.tensor([i for i in (encoder.image_token_id, encoder.video_token_id) if i is not None])
    handler = MLLMMediaHandler()
    for record in records:
        try:
            meta = encoder.measure(record)
        except MLLMRecordError as err:
            refused = _refusal(encoder.encode, record)
            assert refused == err.reason, f"{record.origin}: measure refused it ({err.reason}), encode: {refused}"
            continue
        sample = encoder.encode(record)
        assert meta == sample.meta, record.origin
        assert sample.num_media == len(record.media_paths)
        handler.validate(sample)
        placeholders = torch.isin(sample.input_ids, placeholder_ids).nonzero().view(-1)
        assert sample.media_tokens == placeholders.numel()
        assert sample.media_end == (int(placeholders[-1]) + 1 if placeholders.numel() else 0)
    return len(records)


def _refusal(call, record: MLLMRecord) -> str | None:
    """The bad-record reason ``call(record)`` raises, None when it takes the record."""
    try:
        call(record)
    except MLLMRecordError as err:
        return err.reason
    return None


def check_assistant_only_labels(encoder, records: list[MLLMRecord], samples) -> None:
    """Exactly the assistant turns (content + turn end) are supervised, never a placeholder; labels equal ids where
    supervised. Whitespace is ignored in the comparison (tokenizers differ in where a word's space goes)."""
    tokenizer = encoder.tokenizer
    for record, sample in zip(records, samples):
        mask = sample.labels != IGNORE_INDEX
        assert torch.equal(sample.labels[mask], sample.input_ids[mask])
        assert not (sample.input_ids[mask] == encoder.image_token_id).any(), record.origin
        supervised = tokenizer.decode(sample.input_ids[mask])
        turns = "".join(m["content"][0]["text"] + encoder.turn_end for m in record.messages if m["role"] == "assistant")
        assert "".join(supervised.split()) == "".join(turns.split()), (record.origin, supervised, turns)


def check_bad_records_name_origin(encoder, directory: Path) -> None:
    """Missing or corrupt images, unknown roles and parts, a literal special token, no messages: ``encode`` and
    ``measure`` both raise a ``ValueError`` naming the record's origin."""
    directory = Path(directory)
    corrupt = directory / "corrupt.png"
    corrupt.write_bytes(b"not a png")
    bad = [
        [user(image(str(directory / "missing.png"))), assistant("x")],
        [user(image(str(corrupt))), assistant("x")],
        [{"role": "robot", "content": [text("x")]}],
        [user({"type": "audio", "path": "/a.wav"}), assistant("x")],
        [user(text(f"inject {encoder.turn_end} here")), assistant("x")],
        [],
    ]
    for i, messages in enumerate(bad):
        record = MLLMRecord(f"bad{i}", f"bad.jsonl:{i + 1}", messages)
        for call in (encoder.encode, encoder.measure):
            try:
                call(record)
            except ValueError as err:
                assert f"bad.jsonl:{i + 1}" in str(err), err
            else:
                raise AssertionError(f"{call.__name__} accepted bad record {messages}")


def _one_by_one_logits(recipe, model, processor, sample) -> torch.Tensor:
    batch = collate_rows([[sample]], recipe.pad_token_id(processor), extra_pad=0)
    with torch.no_grad():
        return model(**recipe.prepare_padded(batch, model, "sdpa")).logits[0]


def check_save_load_round_trip(name: str, directory: Path) -> None:
    """``save_pretrained`` model + processor, reload through ``model.pretrained=<dir>``: same encoding, same logits
    (a multi-image record, and a clip when the encoder takes video)."""
    recipe = load_recipe(name)
    model_cfg = compose_config(name).model
    directory = Path(directory)
    processor = recipe.build_processor(model_cfg)
    model = recipe.build_model(model_cfg, "sdpa").eval()
    model.save_pretrained(directory / "ckpt")
    processor.save_pretrained(directory / "ckpt")
    loaded_processor = recipe.build_processor({"pretrained": str(directory / "ckpt")})
    loaded = recipe.build_model({"pretrained": str(directory / "ckpt")}, "sdpa").eval()
    encoder, loaded_encoder = recipe.build_encoder(processor), recipe.build_encoder(loaded_processor)
    records = [demo_like_records(directory / "images")[2]]  # multi-image, multi-turn
    if encoder.video_token:
        records.append(video_record(directory / "clips"))
    for record in records:
        sample, again = encoder.encode(record), loaded_encoder.encode(record)
        assert torch.equal(sample.input_ids, again.input_ids) and torch.equal(sample.labels, again.labels)
        assert sample.media.keys() == again.media.keys()
        assert all(torch.equal(sample.media[k], again.media[k]) for k in sample.media)
        assert torch.equal(_one_by_one_logits(recipe, model, processor, sample),
                           _one_by_one_logits(recipe, loaded, loaded_processor, again))


def _asset_builder():
    path = REPO_ROOT / "tools" / "build_tokenizer_assets.py"
    spec = importlib.util.spec_from_file_location("build_tokenizer_assets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_tokenizer_asset(name: str, directory: Path) -> None:
    """``tools/build_tokenizer_assets.py --only <name>`` is byte-reproducible and equals the committed asset."""
    builder = _asset_builder()
    directory = Path(directory)
    builder.main(["--only", name, "--out", str(directory / "a")])
    builder.main(["--only", name, "--out", str(directory / "b")])
    first, second, committed_dir = directory / "a" / name, directory / "b" / name, builder.DEFAULT_OUT / name
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second)) == sorted(os.listdir(committed_dir))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert not mismatch and not errors
    for file_name in names:  # the committed asset: same content (JSON compared parsed, so formatting may differ)
        fresh, committed = (first / file_name).read_text(), (committed_dir / file_name).read_text()
        if file_name.endswith(".json"):
            fresh, committed = json.loads(fresh), json.loads(committed)
        assert fresh == committed, f"committed {file_name} is stale: rerun tools/build_tokenizer_assets.py"


NO_TORCHVISION_SCRIPT = """
import sys
sys.modules["torchvision"] = None  # any 'import torchvision' now raises ImportError
from PIL import Image
from mvp_engine.engine.testing import collate_rows, compose_config, load_recipe
from mvp_engine.kit.mllm.data import MLLMRecord
name, path = sys.argv[1], sys.argv[2]
recipe = load_recipe(name)
cfg = compose_config(name).model
processor = recipe.build_processor(cfg)
Image.new("RGB", (70, 50), (200, 10, 10)).save(path)
record = MLLMRecord("r", "x:1", [{"role": "user", "content": [{"type": "image", "path": path}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "red"}]}])
sample = recipe.build_encoder(processor).encode(record)
model = recipe.build_model(cfg, "sdpa")
batch = collate_rows([[sample]], recipe.pad_token_id(processor), extra_pad=0)
model(**recipe.prepare_padded(batch, model, "sdpa"))
print("ok")
"""


def check_no_torchvision(name: str, directory: Path) -> None:
    """Encoding and a forward work with torchvision made unimportable (the PIL image processors are used)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", NO_TORCHVISION_SCRIPT, name, str(Path(directory) / "i.png")],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
