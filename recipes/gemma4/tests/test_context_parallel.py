"""Gemma 4 under context parallelism: refused at start, on every rank, with one line naming the key and the heads.
Its full-attention layers hold one key/value head (as the released checkpoints do) and Ulysses splits heads over
the CP group; a silent fallback would train something else. DDP on Gemma 4 is its ``DistributedSuite``'s run."""

import pytest

import mvp_engine.engine.testing as kit

RECIPE = "gemma4"
REFUSES = ("CP",)  # for the coverage table (testkit.coverage)


@pytest.mark.launch
def test_context_parallelism_is_refused_with_one_line(tmp_path):
    result = kit.train(RECIPE, tmp_path, ["+packing=greedy", f"data.sources=[{kit.shared_mixed_jsonl()}]",
                                          "data.max_seq_len=320", "train.micro_batch_size=1",
                                          "train.context_parallel_size=2"], nproc=2, check=False)
    assert result.returncode == 1
    stops = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert len(stops) == 2, result.stderr[-3000:]  # each rank, before any step
    assert stops[0].startswith("config error: train.context_parallel_size=2: Ulysses splits heads over the CP group")
    assert "num_global_key_value_heads=1" in stops[0] or "is not divisible by 2" in stops[0], stops[0]
    assert "Traceback" not in result.stderr
