"""Encoder and artifact checks every recipe runs: measure == encode, assistant-only labels, errors naming the
record, the encoding equal to the family's transformers processor's, save/load round trip, a reproducible tokenizer
asset, no torchvision needed."""

from __future__ import annotations

import copy
import filecmp
import functools
import importlib.util
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.video_utils import VideoMetadata

from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMMediaHandler, MLLMRecord, MLLMRecordError, read_video_info
from mvp_engine.kit.mllm.data.images import load_image

from ..config import CONF_DIR
from ..model_folder import check_model_folder
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


# ------------------------------------------------------------------------- encoding == the family's processor

TOKEN_TYPE_FIELDS = ("token_type_ids", "mm_token_type_ids")  # per-token modality maps processors return
NOT_COMPARED = ("attention_mask",)  # all ones on one unpadded row: the collator builds the real one


class EncoderVideoProcessor:
    """Stands in for the family's transformers video processor, which needs torchvision (this project does
    without): it hands the transformers processor the encoder's own clips (``encode_videos``: frames decoded and
    patched) and each clip's ``VideoMetadata`` with the frames the encoder's ``video_processor.frame_indices``
    samples, so the transformers processor writes its own text for every clip (placeholder runs, timestamps) and
    its own per-clip fields (e.g. seconds per temporal patch) from them. The comparison therefore proves the layout
    around a clip; frame sampling and pixels are compared with transformers' video code by the recipes' video
    tests. Called with the clips' paths and ``video_metadata`` (the rate a frame folder is read at)."""

    def __init__(self, encoder):
        self.encoder = encoder
        video = encoder.video_processor
        self.patch_size, self.merge_size = int(video.patch_size), int(video.merge_size)
        self.temporal_patch_size = int(video.temporal_patch_size)

    def __call__(self, videos, video_metadata=None, **kwargs) -> dict:
        infos = [read_video_info(path, meta.fps) for path, meta in zip(videos, video_metadata, strict=True)]
        media, _ = self.encoder.encode_videos(infos)
        sampler = self.encoder.video_processor
        metadata = [VideoMetadata(info.num_frames, fps=info.fps, width=info.width, height=info.height,
                                  frames_indices=sampler.frame_indices(info)) for info in infos]
        return {**media, "video_metadata": metadata}


def transformers_processor(processor_cls, encoder, **settings):
    """The family's transformers processor ``processor_cls``, built here from what the encoder was built from (no
    download): its image processor, chat template and a copy of its tokenizer (some constructors add tokens to the
    tokenizer they get: Gemma 4's adds ``<|video|>``), plus ``settings`` (the model config's numbers the processor
    takes, e.g. tokens per image). A processor that takes a video processor gets an :class:`EncoderVideoProcessor`
    when the encoder takes video, else none; the class check is lifted for exactly those two, as transformers'
    video processor classes cannot be imported without torchvision."""

    class Processor(processor_cls):
        def check_argument_for_proper_class(self, name, argument):
            if argument is None or isinstance(argument, EncoderVideoProcessor):
                return None
            return super().check_argument_for_proper_class(name, argument)

    Processor.__name__ = Processor.__qualname__ = processor_cls.__name__
    kwargs = {"image_processor": encoder.image_processor, "tokenizer": copy.deepcopy(encoder.tokenizer),
              "chat_template": encoder.tokenizer.chat_template}
    if "video_processor" in inspect.signature(processor_cls.__init__).parameters:
        kwargs["video_processor"] = EncoderVideoProcessor(encoder) if encoder.video_token else None
    return Processor(**kwargs, **settings)


@dataclass
class ProcessorComparison:
    """What :func:`check_encoder_matches_processor` compared: the fields per record, and the media fields the
    encoder emits that the processor does not return (the recipe names them; its own tests check them)."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    encoder_only: set[str] = field(default_factory=set)

    def line(self) -> str:
        records = ", ".join(f"{record_id} ({' '.join(names)})" for record_id, names in self.fields.items())
        return f"compared {len(self.fields)} records: {records}; encoder-only fields: {sorted(self.encoder_only)}"


def _first_difference(encoder, theirs: torch.Tensor, ours: torch.Tensor) -> str:
    """Where two id rows part, decoded around that place, for an assertion message a person can read."""
    common = min(len(theirs), len(ours))
    at = next((i for i in range(common) if theirs[i] != ours[i]), common)
    window = slice(max(0, at - 8), at + 8)
    return (f"lengths {len(theirs)} (processor) / {len(ours)} (encoder), first difference at {at}: processor "
            f"{encoder.tokenizer.decode(theirs[window])!r}, encoder {encoder.tokenizer.decode(ours[window])!r}")


def check_encoder_matches_processor(encoder, hf_processor, records: list[MLLMRecord]) -> ProcessorComparison:
    """``encode`` gives what the family's transformers processor gives on the chat template's text of each record
    (its images, and its clips through an :class:`EncoderVideoProcessor`): the same ``input_ids``; the same token
    types (the encoder's token type field, or where it emits none its ``placeholder_types``, which the recipe's
    packed inputs derive alike); every other field the processor returns, equal in value, dtype and shape, among
    the encoder's media. A field the processor returns and the encoder lacks fails; the encoder's extra media fields
    are reported. A record the encoder refuses is an error here: only records both sides take belong in it."""
    comparison = ProcessorComparison()
    for record in records:
        ours = encoder.encode(record)
        images = [load_image(path) for path in record.image_paths]
        clips = [read_video_info(part["path"], part.get("fps")) for part in record.parts("video")]
        inputs = {"images": [images]} if images else {}
        if clips:
            inputs.update(videos=[clip.path for clip in clips], video_metadata=[
                VideoMetadata(clip.num_frames, fps=clip.fps, width=clip.width, height=clip.height) for clip in clips])
        text = hf_processor.apply_chat_template(record.messages, tokenize=False)
        theirs = hf_processor(text=[text], return_tensors="pt", **inputs)
        ids = theirs["input_ids"]
        assert ids.shape[0] == 1, (record.origin, tuple(ids.shape))
        assert torch.equal(ids[0], ours.input_ids), \
            f"{record.origin}: {_first_difference(encoder, ids[0], ours.input_ids)}"
        compared = ["input_ids"]
        for key, value in theirs.items():
            if key == "input_ids" or key in NOT_COMPARED:
                continue
            if key in TOKEN_TYPE_FIELDS:
                expected = ours.token_fields.get(key, encoder.placeholder_types(ours.input_ids))
                assert value[0].tolist() == expected.tolist(), f"{record.origin}: {key} differs"
            else:
                assert key in ours.media, f"{record.origin}: the processor returns {key!r}, the encoder does not"
                expected, value = ours.media[key], torch.as_tensor(value)
                assert value.dtype == expected.dtype and value.shape == expected.shape, \
                    f"{record.origin}: {key} is {value.dtype} {tuple(value.shape)}, the encoder's " \
                    f"{expected.dtype} {tuple(expected.shape)}"
                assert torch.equal(value, expected), f"{record.origin}: {key} differs"
            compared.append(key)
        comparison.fields[record.record_id] = compared
        comparison.encoder_only.update(set(ours.media) - set(theirs))
    return comparison


def _one_by_one_logits(recipe, model, processor, sample) -> torch.Tensor:
    batch = collate_rows([[sample]], recipe.pad_token_id(processor), extra_pad=0)
    with torch.no_grad():
        return model(**recipe.prepare_padded(batch, model, "sdpa")).logits[0]


def check_save_load_round_trip(name: str, directory: Path) -> None:
    """``save_pretrained`` model + processor, reload through ``model.pretrained=<dir>``: same encoding, same logits
    (a multi-image record, and a clip when the encoder takes video). The folder passes the engine's folder check,
    under the ``model_type`` the recipe declares (``Recipe.model_types``)."""
    recipe = load_recipe(name)
    model_cfg = compose_config(name).model
    directory = Path(directory)
    processor = recipe.build_processor(model_cfg)
    model = recipe.build_model(model_cfg, "sdpa").eval()
    model.save_pretrained(directory / "ckpt")
    processor.save_pretrained(directory / "ckpt")
    assert recipe.model_types, f"recipes/{name}/model.py declares no MODEL_TYPES (its folders' config.json model_type)"
    check_model_folder(directory / "ckpt", recipe.model_types)
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


@functools.cache
def _asset_builder():
    """``tools/build_tokenizer_assets.py``, loaded by its path once per process (tools are command lines, not a
    package), its BPE training memoised for the process (:func:`_memoised`)."""
    path = REPO_ROOT / "tools" / "build_tokenizer_assets.py"
    spec = importlib.util.spec_from_file_location("build_tokenizer_assets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "train_bpe"):
        module.train_bpe = _memoised(module.train_bpe)
    return module


def _memoised(train):
    """``train`` (the tool's ``train_bpe``: a deterministic BPE training on its fixed corpus) memoised on its
    arguments, tokenizers' components keyed by their serialised state and ``initial_alphabet`` as the set the
    trainer makes of it (``ByteLevel.alphabet()`` lists it in another order each call): recipes of one family train
    the same BPE (the Qwen-2 ones: one training for three assets), so a test session trains each distinct BPE once.
    A caller gets its own copy of the result."""
    results = {}
    signature = inspect.signature(train)

    def key(name, value):
        if name == "initial_alphabet" and value is not None:
            return repr(sorted(value))
        return value.__getstate__() if type(value).__module__.startswith("tokenizers") else repr(value)

    @functools.wraps(train)
    def cached(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = tuple((name, key(name, value)) for name, value in bound.arguments.items())
        if call not in results:
            results[call] = train(*args, **kwargs)
        return copy.deepcopy(results[call])

    return cached


def check_tokenizer_asset(name: str, directory: Path) -> None:
    """``tools/build_tokenizer_assets.py --only <name>`` writes the committed asset byte for byte: one fresh build
    in this process against the files another process committed, which proves the build reproducible (the tool
    writes JSON with sorted keys) and the asset current."""
    builder = _asset_builder()
    fresh, committed = Path(directory) / name, builder.DEFAULT_OUT / name
    builder.main(["--only", name, "--out", str(directory)])
    names = sorted(os.listdir(committed))
    assert sorted(os.listdir(fresh)) == names, f"{name}: files {sorted(os.listdir(fresh))} built, {names} committed"
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, names, shallow=False)
    assert not mismatch and not errors, \
        f"{name}: committed {mismatch + errors} differ from a fresh build: rerun tools/build_tokenizer_assets.py"


NO_TORCHVISION_SCRIPT = """
import sys, traceback
sys.modules["torchvision"] = None  # any 'import torchvision' now raises ImportError
from PIL import Image
from mvp_engine.engine.testkit import collate_rows, compose_config, load_recipe
from mvp_engine.kit.mllm.data import MLLMRecord
path, names = sys.argv[1], sys.argv[2:]
Image.new("RGB", (70, 50), (200, 10, 10)).save(path)
record = MLLMRecord("r", "x:1", [{"role": "user", "content": [{"type": "image", "path": path}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "red"}]}])
failed = []
for name in names:
    try:
        recipe = load_recipe(name)
        cfg = compose_config(name).model
        processor = recipe.build_processor(cfg)
        sample = recipe.build_encoder(processor).encode(record)
        model = recipe.build_model(cfg, "sdpa")
        batch = collate_rows([[sample]], recipe.pad_token_id(processor), extra_pad=0)
        model(**recipe.prepare_padded(batch, model, "sdpa"))
        print("ok", name)
    except Exception:
        traceback.print_exc()
        print("FAILED", name)
        failed.append(name)
sys.exit(1 if failed else 0)
"""


def check_no_torchvision(names: list[str], directory: Path) -> None:
    """Every recipe in ``names``, one after another in one fresh interpreter where torchvision cannot be imported
    (the PIL image processors are used): encoding an image record and a forward work. Each failing recipe is named
    and the others still run. A module that pulls torchvision fails to import and is not kept, so every recipe
    whose import chain reaches it fails, not only the first (checked once by hand: ``import torchvision`` added to
    ``recipes/gemma/encoder.py`` failed gemma3 and gemma4, llava passed)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", NO_TORCHVISION_SCRIPT, str(Path(directory) / "i.png"), *names],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    passed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert result.returncode == 0 and passed == list(names), \
        f"passed {passed} of {list(names)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
