"""Elastic resume: a checkpoint taken on N ranks resumes on M ranks with the same global batch and trains the same
samples in the same optimizer steps as the uninterrupted N-rank run.

Why it can: packs are assigned to optimizer steps before ranks (``tests/test_balance.py`` checks every split of one
global batch at the dataset), the position saved is a step count, and ``torch.distributed.checkpoint`` reshards the
model and optimizer on load. Checked here with real launches (llava, gloo): 2 ranks x accumulation 1 -> 1 rank x
accumulation 2 and back, mid-epoch, on epochs that end on a short step; the DCP files a 2-rank checkpoint holds; the
one-line refusals when the global batch changes, or when ``train.drop_last`` would leave out other packs. FSDP2
(``train.sharding=fsdp2``): a sharded checkpoint resumes unsharded on 1 rank and an unsharded one resumes sharded,
and each rank's ``.distcp`` holds only its shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import mvp_engine.engine.testing as kit
from mvp_engine.engine.checkpoint import CHECKPOINTS, DCP_METADATA, load_run_state

RECIPE = "llava"
COVERS = ("elastic", "resume", "DDP", "FSDP2")  # on RECIPE, for the coverage table (testkit.coverage)
pytestmark = pytest.mark.slow
# what a split of the same global batch may not change: losses sum in another order, nothing else moves
LOSS_TOL, GRAD_NORM_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-5
SAME_COUNTS = ("step", "epoch", "lr", "effective_tokens", "supervised_tokens", "samples", "packs")


def common(data: Path, packing: str, accumulation: int, sharding: str = "none") -> list[str]:
    return [f"+packing={packing}", f"data.sources=[{data}]", "data.max_seq_len=160", "train.epochs=2",
            "train.micro_batch_size=1", f"train.gradient_accumulation_steps={accumulation}",
            "train.learning_rate=5e-3", "train.warmup_ratio=0.2", "train.keep_last=100", f"train.sharding={sharding}"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return kit.write_mixed_jsonl(tmp_path_factory.mktemp("elastic_data"), num_records=25)


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """Uninterrupted runs per (ranks, accumulation, sharding, packing), a checkpoint after every step; made on first
    use."""
    made: dict[tuple[int, int, str, str], Path] = {}

    def get(nproc: int, accumulation: int, sharding: str, packing: str) -> Path:
        key = (nproc, accumulation, sharding, packing)
        if key not in made:
            run_dir = tmp_path_factory.mktemp(f"reference_{nproc}x{accumulation}_{sharding}_{packing}")
            kit.train(RECIPE, run_dir, [*common(data, packing, accumulation, sharding), "train.save_every_steps=1"],
                     nproc=nproc)
            made[key] = run_dir
        return made[key]

    return get


def assert_same_training(resumed: list[dict], expected: list[dict]) -> None:
    assert [{k: m[k] for k in SAME_COUNTS} for m in resumed] == [{k: m[k] for k in SAME_COUNTS} for m in expected]
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, expected))
    grad_norm = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(resumed, expected))
    print(f"max |loss difference| {loss:.2e}, max |grad_norm difference| {grad_norm:.2e} over {len(resumed)} steps")
    assert loss <= LOSS_TOL and grad_norm <= GRAD_NORM_TOL


# (ranks, accumulation, sharding) saved -> resumed: DDP both ways, and FSDP2 shards resumed unsharded and back
@pytest.mark.parametrize("saved,resumed,packing", [
    ((2, 1, "none"), (1, 2, "none"), "greedy"), ((1, 2, "none"), (2, 1, "none"), "bfd"),
    ((2, 1, "fsdp2"), (1, 2, "none"), "greedy"), ((1, 2, "none"), (2, 1, "fsdp2"), "bfd")])
def test_a_checkpoint_resumes_on_another_world_size_with_the_same_global_batch(references, data, tmp_path, saved,
                                                                              resumed, packing):
    reference = references(*saved, packing)
    expected = kit.read_metrics(reference)
    assert any(m["packs"] == 1 for m in expected), "an epoch must end on a short step (one pack of two)"
    first_epoch = [m["step"] for m in expected if m["epoch"] == 0]
    step = first_epoch[len(first_epoch) // 2]
    checkpoint = reference / CHECKPOINTS / f"step_{step:08d}"
    assert load_run_state(checkpoint).epoch_steps_done == step
    kit.train(RECIPE, tmp_path, [*common(data, packing, *resumed[1:]), f"train.resume_from={checkpoint}"],
             nproc=resumed[0])
    assert_same_training(kit.read_metrics(tmp_path), expected[step:])
    summary = kit.read_summary(tmp_path)
    assert summary["world_size"] == resumed[0] and summary["resumed_from"] == str(checkpoint)
    assert summary["totals"]["samples"] == kit.read_summary(reference)["totals"]["samples"]
    assert kit.max_weight_difference(kit.final_weights(tmp_path), kit.final_weights(reference)) <= WEIGHT_TOL


def chunk_files(checkpoint: Path) -> dict[str, dict[tuple[int, ...], str]]:
    """Per model tensor of a DCP checkpoint: the file each of its chunks (by offset) is stored in."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    chunks: dict[str, dict[tuple[int, ...], str]] = {}
    for index, stored in metadata.storage_data.items():
        if index.fqn.startswith("model.") and index.offset is not None:
            chunks.setdefault(index.fqn, {})[tuple(index.offset)] = stored.relative_path
    return chunks


@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
def test_a_two_rank_checkpoint_is_dcp_metadata_and_one_distcp_file_per_rank(references, sharding):
    """Under FSDP2 every rank writes only its shard of each tensor (the first rows in rank 0's file, the rest in rank
    1's); under DDP every tensor is whole, written once by one of the ranks."""
    checkpoint = references(2, 1, sharding, "greedy") / CHECKPOINTS / "step_00000001"
    files = sorted(p.name for p in checkpoint.iterdir())
    assert DCP_METADATA in files and {"rng_0.pt", "rng_1.pt"} <= set(files)
    distcp = [f for f in files if f.endswith(".distcp")]
    assert distcp == ["__0_0.distcp", "__1_0.distcp"]
    model_bytes = sum(v.numel() * v.element_size() for v in kit.final_weights(checkpoint.parents[1]).values())
    full_state = 3 * model_bytes  # weights and AdamW's two moments
    assert all((checkpoint / f).stat().st_size < 0.6 * full_state for f in distcp)
    chunks = chunk_files(checkpoint)
    assert chunks
    if sharding == "fsdp2":
        split = [c for c in chunks.values() if len(c) == 2]
        assert len(split) >= 0.5 * len(chunks)
        assert all(sorted(c.values()) == distcp for c in split)
        assert all(c[min(c)] == "__0_0.distcp" for c in split)
    else:
        assert all(len(c) == 1 for c in chunks.values())
        assert {f for c in chunks.values() for f in c.values()} == set(distcp)


@pytest.mark.parametrize("overrides,named", [
    ((), "global batch of 2 packs (world_size=2 x micro_batch_size=1 x gradient_accumulation_steps=1); this run "
         "has 1 (1 x 1 x 1)"),
    (("train.gradient_accumulation_steps=2", "train.drop_last=true"), "world_size x micro_batch_size = 2 x 1; this "
                                                                      "run has 1 x 1"),
])
def test_a_resume_that_changes_what_is_trained_is_refused_with_one_line(references, data, tmp_path, overrides,
                                                                        named):
    checkpoint = references(2, 1, "none", "greedy") / CHECKPOINTS / "step_00000002"
    result = kit.train(RECIPE, tmp_path, [*common(data, "greedy", 1), f"train.resume_from={checkpoint}",
                                          *overrides], check=False)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: train.resume_from:") and named in last, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
