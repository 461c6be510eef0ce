"""Packed Qwen2-VL forwards equal one-by-one forwards; the encoder's measure equals encode; guards fire.

Everything runs on the tiny random model (``conf/model/qwen2_vl_tiny.yaml``) in fp32 on CPU.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from mvp_engine.kit.mllm.data.sample import IGNORE_INDEX, MLLMRecord
from mvp_engine.packing import check_packed_model_kwargs
from recipes.qwen2_vl.model import DEFAULT_TOKENIZER_DIR, build_model, build_processor
from recipes.qwen2_vl.packed import mm_token_type_ids, packed_position_ids, prepare_packed, prepare_padded

from .conftest import REPO_ROOT, assistant, hand_collate, image, kit_collate, text, user, write_image

TOL = 1e-5
BACKENDS = ["eager", "sdpa"]


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tiny_cfg):
    out = {}
    for backend in BACKENDS:
        model = build_model(tiny_cfg, backend)
        model.eval()
        out[backend] = model
    return out


@pytest.fixture(scope="module")
def packed_rows(samples):
    """Two packed rows: [image, text-only, multi-image] and [text-only, image]; both end in padding."""
    return [[samples[0], samples[1], samples[2]], [samples[3], samples[4]]]


@pytest.fixture(scope="module")
def packed_batch(packed_rows, processor):
    batch = kit_collate(packed_rows, processor.pad_token_id)
    batch = batch if batch is not None else hand_collate(packed_rows, processor.pad_token_id)
    assert (batch["pack_segment_ids"][:, -1] == -1).all(), "every row must end in padding"
    return batch


def one_by_one_logits(model, sample) -> torch.Tensor:
    """The reference: the sample alone, positions computed by the model itself."""
    input_ids = sample.input_ids.unsqueeze(0)
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if sample.num_media:
        kwargs.update(sample.media, mm_token_type_ids=mm_token_type_ids(input_ids, model.config))
    with torch.no_grad():
        return model(**kwargs).logits[0]


def segment_slices(batch):
    """(row, start, end, sample index in row order) of every real segment."""
    out = []
    for row, segs in enumerate(batch["pack_segment_ids"].tolist()):
        start = 0
        for i in range(1, len(segs) + 1):
            if i == len(segs) or segs[i] != segs[start]:
                if segs[start] >= 0:
                    out.append((row, start, i))
                start = i
    return out


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of next-token CE over supervised positions (labels aligned with input_ids; shifted here)."""
    shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((shift_labels != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_logits_equal_one_by_one(models, packed_batch, packed_rows, backend):
    model = models[backend]
    kwargs = prepare_packed(packed_batch, model, backend)
    with torch.no_grad():
        logits = model(**kwargs).logits
    flat_samples = [s for row in packed_rows for s in row]
    slices = segment_slices(packed_batch)
    assert len(slices) == len(flat_samples)
    worst = 0.0
    for (row, start, end), sample in zip(slices, flat_samples):
        assert torch.equal(packed_batch["input_ids"][row, start:end], sample.input_ids)
        diff = (logits[row, start:end] - one_by_one_logits(model, sample)).abs().max().item()
        worst = max(worst, diff)
    print(f"[{backend}] max |packed - one-by-one| logit diff = {worst:.3e}")
    assert worst <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_loss_and_grads_equal_separate(models, packed_batch, packed_rows, backend):
    model = models[backend]
    params = [p for p in model.parameters() if p.requires_grad]

    model.zero_grad()
    kwargs = prepare_packed(packed_batch, model, backend)
    total, count = token_ce_sum(model(**kwargs).logits, packed_batch["labels"])
    packed_loss = total / count
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in params]

    model.zero_grad()
    flat_samples = [s for row in packed_rows for s in row]
    sums, counts = [], []
    for sample in flat_samples:
        input_ids = sample.input_ids.unsqueeze(0)
        kw = {"input_ids": input_ids, "use_cache": False}
        if sample.num_media:
            kw.update(sample.media, mm_token_type_ids=mm_token_type_ids(input_ids, model.config))
        s, n = token_ce_sum(model(**kw).logits, sample.labels.unsqueeze(0))
        sums.append(s)
        counts.append(n)
    assert sum(counts) == count  # the first label of every segment was already ignored in each sample
    per_sample = [s / n for s, n in zip(sums, counts)]
    weighted = sum(loss * n for loss, n in zip(per_sample, counts)) / sum(counts)
    weighted.backward()
    assert abs(packed_loss.item() - weighted.item()) <= TOL

    worst = 0.0
    for p, g_packed in zip(params, packed_grads):
        ref = p.grad
        rel = (g_packed - ref).norm() / ref.norm().clamp_min(1e-12)
        if ref.norm() > 1e-8:
            worst = max(worst, rel.item())
        else:
            assert g_packed.abs().max() <= 1e-8
    model.zero_grad()
    print(f"[{backend}] loss {packed_loss.item():.6f} vs {weighted.item():.6f}; max relative grad diff {worst:.3e}")
    assert worst <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_packed_detection_is_equivalent(models, packed_batch, backend):
    """Backs the choice in packed.py: without our mask, the model's own detection from the 4-row positions gives
    the same logits everywhere (so the explicit mask is a robustness choice, not a behaviour change)."""
    model = models[backend]
    kwargs = prepare_packed(packed_batch, model, backend)
    without_mask = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    with torch.no_grad():
        explicit = model(**kwargs).logits
        detected = model(**without_mask).logits
    assert (explicit - detected).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_baseline_equals_one_by_one(models, samples, processor, backend):
    model = models[backend]
    rows = [[samples[2]], [samples[1]], [samples[0]]]
    batch = hand_collate(rows, processor.pad_token_id)
    kwargs = prepare_padded(batch, model, backend)
    assert kwargs["attention_mask"].dim() == 2 and kwargs["use_cache"] is False
    with torch.no_grad():
        logits = model(**kwargs).logits
    for b, (sample,) in enumerate(rows):
        diff = (logits[b, : sample.length] - one_by_one_logits(model, sample)).abs().max().item()
        assert diff <= TOL


def test_padded_refuses_packed_rows(models, packed_batch):
    with pytest.raises(ValueError, match="more than one segment"):
        prepare_padded(packed_batch, models["sdpa"], "sdpa")


def test_kit_collator_matches_contract(packed_rows, processor):
    kit = kit_collate(packed_rows, processor.pad_token_id)
    if kit is None:
        pytest.skip("MLLMPack / MLLMCollator not in the DataKit yet")
    hand = hand_collate(packed_rows, processor.pad_token_id)
    for key in ("input_ids", "labels", "pack_segment_ids", "position_ids", "source_sample_num", "cu_seqlens",
                "pixel_values", "image_grid_thw", "media_segment_ids", "media_batch_index"):
        assert torch.equal(kit[key], hand[key]), key
    assert kit["max_seqlen"] == hand["max_seqlen"]


# ---------------------------------------------------------------------------------------------- golden M-RoPE


def test_packed_mrope_positions_golden(models):
    """Hand-made case. Row 0: [t t vs I*4 ve t] (grid 1x4x4) + [t t t] + 2 pad.
    Row 1: [t vs I*2 ve t t] (grid 1x2x4) + [vs I*2 ve] (grid 1x4x2) + 3 pad. 'vs'/'ve' are text for M-RoPE."""
    model = models["sdpa"]
    cfg = model.config
    t, vs, ve, im, pad = 100, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, 0
    row0 = [t, t, vs, im, im, im, im, ve, t] + [t, t, t] + [pad, pad]
    row1 = [t, vs, im, im, ve, t, t] + [vs, im, im, ve] + [pad, pad, pad]
    seg0 = [0] * 9 + [1] * 3 + [-1] * 2
    seg1 = [0] * 7 + [1] * 4 + [-1] * 3
    batch = {
        "input_ids": torch.tensor([row0, row1]),
        "pack_segment_ids": torch.tensor([seg0, seg1]),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 2]]),
        "media_batch_index": torch.tensor([0, 1, 1]),
        "media_segment_ids": torch.tensor([0, 0, 1]),
    }
    expected = torch.tensor([
        # text row
        [[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 0, 1],
         [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 1, 2]],
        # temporal
        [[0, 1, 2, 3, 3, 3, 3, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 2, 4, 5, 6, 0, 1, 1, 3, 0, 1, 2]],
        # height
        [[0, 1, 2, 3, 3, 4, 4, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 2, 4, 5, 6, 0, 1, 2, 3, 0, 1, 2]],
        # width
        [[0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 0, 1],
         [0, 1, 2, 3, 4, 5, 6, 0, 1, 1, 3, 0, 1, 2]],
    ])
    assert torch.equal(packed_position_ids(batch, model), expected)


def test_mrope_refuses_misassigned_media(models):
    model = models["sdpa"]
    cfg = model.config
    im = cfg.image_token_id
    batch = {
        "input_ids": torch.tensor([[1, im, 1, 1, 1, 1]]),
        "pack_segment_ids": torch.tensor([[0, 0, 0, 1, 1, 1]]),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
        "media_batch_index": torch.tensor([0]),
        "media_segment_ids": torch.tensor([1]),  # the image tokens are in segment 0
    }
    with pytest.raises(ValueError, match="image tokens"):
        packed_position_ids(batch, model)


# ------------------------------------------------------------------------------------------------------ guards


def test_guard_cache(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    for bad in ({"use_cache": True}, {"use_cache": None}, {"past_key_values": object()}, {"cache": object()}):
        with pytest.raises(ValueError, match="cache"):
            check_packed_model_kwargs({**kwargs, **bad}, "sdpa", position_rows=4)


def test_guard_position_rows(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    for bad in (kwargs["position_ids"][0], kwargs["position_ids"][1:]):
        with pytest.raises(ValueError, match="position_ids"):
            check_packed_model_kwargs({**kwargs, "position_ids": bad}, "sdpa", position_rows=4)


def test_guard_2d_attention_mask(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    ones = torch.ones_like(packed_batch["input_ids"])
    with pytest.raises(ValueError, match="2-D attention_mask"):
        check_packed_model_kwargs({**kwargs, "attention_mask": ones}, "sdpa", position_rows=4)


def test_guard_batch_field_leak(models, packed_batch):
    kwargs = prepare_packed(packed_batch, models["sdpa"], "sdpa")
    with pytest.raises(ValueError, match="cu_seqlens"):
        check_packed_model_kwargs({**kwargs, "cu_seqlens": packed_batch["cu_seqlens"]}, "sdpa", position_rows=4)


def test_guard_backend_mismatch(models, packed_batch):
    with pytest.raises(ValueError, match="attn_implementation"):
        prepare_packed(packed_batch, models["eager"], "sdpa")


def varlen_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                               cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """A CPU stand-in for flash-attention varlen: causal attention within each ``cu_seq_lens_q`` span of the
    flattened (B*L) tokens; plain sdpa when no spans are given (the vision tower's per-image calls)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    if cu_seq_lens_q is None:
        causal = module.is_causal if is_causal is None else is_causal
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             is_causal=bool(causal) and attention_mask is None, scale=scaling)
    else:
        assert attention_mask is None and torch.equal(cu_seq_lens_q, cu_seq_lens_k)
        batch, heads, length, dim = query.shape
        q, k, v = (t.transpose(0, 1).reshape(heads, batch * length, dim) for t in (query, key, value))
        bounds = cu_seq_lens_q.tolist()
        assert max_length_q == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        out = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                        scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])], 1)
        out = out.reshape(heads, batch, length, dim).transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


def test_flash_path_kwargs_give_one_by_one_logits(tiny_cfg, packed_batch, packed_rows):
    """The flash path needs CUDA; on CPU its kwargs (varlen over the flattened batch, no attention_mask) go through
    the model into a registered varlen reference attention and must reproduce one-by-one logits."""
    from transformers import AttentionInterface

    model = build_model(tiny_cfg, "sdpa").eval()
    model.config._attn_implementation = "flash_attention_2"  # only read by prepare_packed's backend check
    kwargs = prepare_packed(packed_batch, model, "flash_attention_2")
    model.config._attn_implementation = "sdpa"
    assert "attention_mask" not in kwargs and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(kwargs["cu_seq_lens_q"], packed_batch["cu_seqlens"].to(torch.int32))
    assert kwargs["max_length_q"] == packed_batch["max_seqlen"]

    AttentionInterface.register("varlen_reference", varlen_reference_attention)
    model.set_attn_implementation("varlen_reference")
    with torch.no_grad():
        logits = model(**kwargs).logits
    flat_samples = [s for row in packed_rows for s in row]
    model.set_attn_implementation("sdpa")
    worst = max((logits[row, start:end] - one_by_one_logits(model, sample)).abs().max().item()
                for (row, start, end), sample in zip(segment_slices(packed_batch), flat_samples))
    print(f"[varlen reference] max |packed - one-by-one| logit diff = {worst:.3e}")
    assert worst <= TOL


# The traps the guards exist for are real in transformers 5.24 (each would silently mix samples).


def _contaminated(model, kwargs, reference) -> bool:
    with torch.no_grad():
        return (model(**kwargs).logits - reference).abs().max().item() > 1e-3


def test_traps_are_real(models, packed_batch):
    model = models["sdpa"]
    kwargs = prepare_packed(packed_batch, model, "sdpa")
    with torch.no_grad():
        good = model(**kwargs).logits
    no_mask = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    assert _contaminated(model, {**no_mask, "use_cache": None}, good)  # eval default: a cache, packing ignored
    assert _contaminated(model, {**no_mask, "position_ids": kwargs["position_ids"][1:]}, good)  # 3-row positions
    ones = torch.ones_like(packed_batch["input_ids"])
    assert _contaminated(model, {**no_mask, "attention_mask": ones}, good)  # all-ones 2-D mask
    # the batch's cu_seqlens reach the vision tower, which takes them as its own patch boundaries
    leaked = {**kwargs, "cu_seqlens": torch.tensor([0, 8, packed_batch["pixel_values"].shape[0]], dtype=torch.int32)}
    assert _contaminated(model, leaked, good)


# --------------------------------------------------------------------------------------------- encoder (measure)


def test_measure_equals_encode_on_many_records(encoder, tmp_path):
    sizes = [(10, 10), (28, 28), (56, 56), (60, 90), (90, 60), (200, 300), (300, 200), (800, 300), (28, 600),
             (33, 47), (500, 500), (57, 113)]
    paths = [write_image(tmp_path / f"im{i}.png", h, w, i) for i, (h, w) in enumerate(sizes)]
    paths.append(str(tmp_path / "im.jpg"))
    from PIL import Image

    Image.new("L", (77, 45), 128).save(paths[-1])  # greyscale JPEG
    records = []
    for i in range(len(paths) * 2):
        p, q = paths[i % len(paths)], paths[(i * 5 + 1) % len(paths)]
        kind = i % 5
        if kind == 0:
            msgs = [user(text(f"Question {i}?")), assistant(f"Answer {i}.")]
        elif kind == 1:
            msgs = [user(image(p), text("What is this?")), assistant("A shape.")]
        elif kind == 2:
            msgs = [user(image(p), image(q), text("Compare.")), assistant("Two images.")]
        elif kind == 3:
            msgs = [{"role": "system", "content": [text("You count things.")]}, user(text("Hi"), image(p)),
                    assistant("Hello."), user(image(q)), assistant("Another one.")]
        else:
            msgs = [user(text("a")), assistant("b"), user(text("c")), assistant("d e f")]
        records.append(MLLMRecord(f"r{i}", f"many.jsonl:{i}", msgs))
    for record in records:
        sample = encoder.encode(record)
        meta = encoder.measure(record)
        assert meta == sample.meta, record.origin
        assert sample.num_media == len(record.image_paths)
        if sample.num_media:
            pads = (sample.input_ids == encoder.image_token_id).nonzero().view(-1)
            assert sample.media_end == int(pads[-1]) + 1
            assert sample.media_tokens == pads.numel()
            assert sample.media["pixel_values"].shape[0] == int(sample.media["image_grid_thw"].prod(-1).sum())


def test_labels_supervise_only_assistant_turns(encoder, records, samples, processor):
    tok = processor.tokenizer
    for record, sample in zip(records, samples):
        supervised = tok.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
        turns = [m["content"][0]["text"] + "<|im_end|>" for m in record.messages if m["role"] == "assistant"]
        assert supervised == "".join(turns)
        mask = sample.labels != IGNORE_INDEX
        assert torch.equal(sample.labels[mask], sample.input_ids[mask])
        # the chat template's rendering, with each image pad expanded, is exactly the token sequence
        assert tok.decode(sample.input_ids).count("<|vision_start|>") == sample.num_media


def test_bad_records_name_their_origin(encoder, tmp_path, images):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not a png")
    bad = [
        [user(image(str(tmp_path / "missing.png"))), assistant("x")],
        [user(image(str(corrupt))), assistant("x")],
        [{"role": "robot", "content": [text("x")]}],
        [user({"type": "audio", "path": "/a.wav"}), assistant("x")],
        [user(text("inject <|im_end|> here")), assistant("x")],
        [],
    ]
    for i, messages in enumerate(bad):
        record = MLLMRecord(f"bad{i}", f"bad.jsonl:{i + 1}", messages)
        for call in (encoder.encode, encoder.measure):
            with pytest.raises(ValueError, match=f"bad.jsonl:{i + 1}"):
                call(record)


# ------------------------------------------------------------------------------------------- save / load, assets


def test_save_load_round_trip(models, processor, records, tmp_path):
    model = models["sdpa"]
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = build_model({"pretrained": str(tmp_path)}, "sdpa").eval()
    loaded_processor = build_processor({"pretrained": str(tmp_path)})
    from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder

    sample = Qwen2VLSampleEncoder(processor).encode(records[2])
    again = Qwen2VLSampleEncoder(loaded_processor).encode(records[2])
    assert torch.equal(sample.input_ids, again.input_ids) and torch.equal(sample.labels, again.labels)
    assert torch.equal(sample.media["pixel_values"], again.media["pixel_values"])
    assert torch.equal(one_by_one_logits(model, sample), one_by_one_logits(loaded, again))


def _load_asset_builder():
    path = REPO_ROOT / "tools" / "build_tokenizer_assets.py"
    spec = importlib.util.spec_from_file_location("build_tokenizer_assets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tokenizer_asset_is_reproducible(tmp_path):
    builder = _load_asset_builder()
    builder.main(["--only", "qwen2_vl", "--out", str(tmp_path / "a")])
    builder.main(["--only", "qwen2_vl", "--out", str(tmp_path / "b")])
    first, second = tmp_path / "a" / "qwen2_vl", tmp_path / "b" / "qwen2_vl"
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second)) == sorted(os.listdir(DEFAULT_TOKENIZER_DIR))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert not mismatch and not errors
    for name in names:  # the committed asset: same content (JSON compared parsed, so formatting may differ)
        fresh, committed = (first / name).read_text(), (DEFAULT_TOKENIZER_DIR / name).read_text()
        if name.endswith(".json"):
            fresh, committed = json.loads(fresh), json.loads(committed)
        assert fresh == committed, f"committed {name} is stale: rerun tools/build_tokenizer_assets.py"


NO_TORCHVISION_SCRIPT = """
import sys
sys.modules["torchvision"] = None  # any 'import torchvision' now raises ImportError
import torch, yaml
from PIL import Image
from mvp_engine.kit.mllm.data.sample import MLLMRecord
from recipes.qwen2_vl import Qwen2VLSampleEncoder, build_model, build_processor
from recipes.qwen2_vl.packed import mm_token_type_ids
cfg = yaml.safe_load(open(sys.argv[1]))
Image.new("RGB", (70, 50), (200, 10, 10)).save(sys.argv[2])
record = MLLMRecord("r", "x:1", [{"role": "user", "content": [{"type": "image", "path": sys.argv[2]}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "red"}]}])
sample = Qwen2VLSampleEncoder(build_processor(cfg)).encode(record)
model = build_model(cfg, "sdpa")
ids = sample.input_ids[None]
model(input_ids=ids, use_cache=False, mm_token_type_ids=mm_token_type_ids(ids, model.config), **sample.media)
print("ok")
"""


def test_no_torchvision_needed(tmp_path):
    """Encoding and a forward work with torchvision made unimportable (the PIL image processor is used)."""
    import subprocess

    cfg = REPO_ROOT / "conf" / "model" / "qwen2_vl_tiny.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", NO_TORCHVISION_SCRIPT, str(cfg), str(tmp_path / "i.png")],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
