"""Shared fixtures for the Qwen2-VL recipe tests: tiny model config, processor, encoder, records, batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mvp_engine.engine.testing import demo_like_records
from mvp_engine.kit.mllm.data.sample import IGNORE_INDEX, MLLMRecord, MLLMSample
from recipes.qwen2_vl.encoder import Qwen2VLSampleEncoder
from recipes.qwen2_vl.model import build_processor

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CFG_PATH = REPO_ROOT / "conf" / "model" / "qwen2_vl_tiny.yaml"


@pytest.fixture(scope="session")
def tiny_cfg() -> dict:
    return yaml.safe_load(TINY_CFG_PATH.read_text())


@pytest.fixture(scope="session")
def processor(tiny_cfg):
    return build_processor(tiny_cfg)


@pytest.fixture(scope="session")
def encoder(processor) -> Qwen2VLSampleEncoder:
    return Qwen2VLSampleEncoder(processor)


@pytest.fixture(scope="session")
def records(tmp_path_factory) -> list[MLLMRecord]:
    """The kit's demo-like records: image samples, text-only samples and a multi-image, multi-turn sample."""
    return demo_like_records(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def samples(encoder, records) -> list[MLLMSample]:
    return [encoder.encode(r) for r in records]


def hand_collate(rows: list[list[MLLMSample]], pad_token_id: int, extra_pad: int = 3) -> dict:
    """A batch built by hand exactly per the DataKit collator contract (see DESIGN.md)."""
    length = max(sum(s.length for s in row) for row in rows) + extra_pad
    batch_size = len(rows)
    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.full((batch_size, length), -1, dtype=torch.long)
    position_ids = torch.zeros((batch_size, length), dtype=torch.long)
    pixel_values, grids, media_segments, media_rows, seqlens = [], [], [], [], []
    for b, row in enumerate(rows):
        pos = 0
        for s_idx, sample in enumerate(row):
            n = sample.length
            input_ids[b, pos:pos + n] = sample.input_ids
            seg_labels = sample.labels.clone()
            seg_labels[0] = IGNORE_INDEX
            labels[b, pos:pos + n] = seg_labels
            segment_ids[b, pos:pos + n] = s_idx
            position_ids[b, pos:pos + n] = torch.arange(n)
            seqlens.append(n)
            if sample.num_media:
                pixel_values.append(sample.media["pixel_values"])
                grids.append(sample.media["image_grid_thw"])
                media_segments += [s_idx] * sample.num_media
                media_rows += [b] * sample.num_media
            pos += n
        if pos < length:
            position_ids[b, pos:] = torch.arange(length - pos)
            seqlens.append(length - pos)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "pack_segment_ids": segment_ids,
        "position_ids": position_ids,
        "source_sample_num": torch.tensor([len(row) for row in rows], dtype=torch.long),
        "cu_seqlens": torch.tensor([0, *np.cumsum(seqlens).tolist()], dtype=torch.int32),
        "max_seqlen": max(seqlens),
    }
    if grids:
        batch.update(
            pixel_values=torch.cat(pixel_values),
            image_grid_thw=torch.cat(grids),
            media_segment_ids=torch.tensor(media_segments, dtype=torch.long),
            media_batch_index=torch.tensor(media_rows, dtype=torch.long),
        )
    return batch
