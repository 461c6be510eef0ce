"""``dpo.reference=precomputed``: the reference model's log-probabilities of every pair, computed in one pass with the
initial model before training, cached on disk and looked up per pair by its record key during training (and
evaluation), so no second model is held and no reference forward runs per step.

Why a cache keyed by a fingerprint: the pass is a forward over the whole data set; a run started again (a resume,
another learning rate or beta, another seed of the shuffle) reuses it as long as nothing that changes a reference
log-probability changed. One cache file per source (training and eval sources alike: adding a source computes that
source alone), named by the digest of

- the data: the source's path as written (a pair's key is its ``id``, else its ``file:line``) and content identity
  (``run_identity.path_content``, what the run identity compares), its image root, and the pair encoder's
  fingerprint (chat template and processor settings, the shared or duplicated prefix);
- the model: the pretrained folder's path and content (``run_identity.model_identity``: every ``model.*``
  setting), and without one the init seed (``train.seed``) beside that config;
- what else changes a log-probability: the recipe, ``data.max_seq_len`` and the packing's (which pairs are kept),
  the attention implementation, ``train.mixed_precision``.

The pass plans and packs each source as an eval source is (record order, the run's packing,
``MLLMDataSpec.eval_spec``); each rank computes its own packs (the shares are disjoint; a rank short of packs gets
all-padding rows, so under FSDP2 every rank runs as many forwards) through the training step's forward and the
chunked log-prob path (``preference.batch_pair_logprobs``: no logits), in eval mode under the run's autocast; the
shares are gathered so every rank holds the union, and rank 0 writes the file (aside, then renamed). Rank 0 alone
reads a cached file and broadcasts what it found, so no rank decides on its own to run the pass's collectives.

A key that names two different pairs (an ``id`` used twice, in one source or across sources, for other content) is
refused in one line: the lookup could not tell them apart. Each entry keeps its pair's content digest for that.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object, send_to_device
from torch.utils.data import DataLoader

from mvp_engine.kit.mllm.data import MLLMDataKit, MLLMSource
from mvp_engine.kit.mllm.data.measure import default_cache_dir
from mvp_engine.kit.mllm.data.pairs import PairEncoder, PreferenceRecord
from mvp_engine.kit.mllm.data.store import digest

from .config import ConfigError
from .preference import PairLogProbs, batch_pair_logprobs, read_pairs
from .run import Run
from .run_identity import model_identity, path_content

CACHE_FOLDER = "dpo_reference"  # under data.cache_dir (or the length cache's default folder)
FORMAT = 1  # raised when what an entry holds changes: older files are then never read

Entry = tuple  # (content digest, chosen log-prob sum, rejected log-prob sum, chosen tokens, rejected tokens)


def _duplicate(key: str, first: str, second: str) -> ConfigError:
    return ConfigError(f"dpo.reference=precomputed looks pairs up by their record key: {key!r} names two different "
                       f"pairs ({first}; {second}): give each pair its own id")


@dataclass
class ReferenceTable:
    """Every pair's reference log-probabilities by record key; called with a batch, the batch's pairs' (row-major,
    segment order: ``preference.pair_logprobs``'s)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # key -> the source it came from (for the refusal)

    def add(self, entries: dict[str, Entry], source: str) -> None:
        for key, entry in entries.items():
            if key in self.entries and self.entries[key][0] != entry[0]:
                raise _duplicate(key, f"source {self.where[key]}", f"source {source}")
            self.entries[key], self.where[key] = entry, source

    def __call__(self, batch: dict) -> PairLogProbs:
        keys = [key for row in batch["sample_ids"] for key in row]
        missing = [key for key in keys if key not in self.entries]
        if missing:
            raise RuntimeError(f"dpo.reference=precomputed: pair {missing[0]!r} has no reference log-probabilities "
                               "(the reference pass over data.sources and data.eval_sources did not reach it)")
        values = torch.tensor([self.entries[key][1:] for key in keys], dtype=torch.float32).reshape(-1, 4)
        # without blocking: a copy from host memory that waits for nothing queued on the device (no host sync)
        return PairLogProbs(*values.to(batch["input_ids"].device, non_blocking=True).unbind(1))


def source_fingerprint(run: Run, source: MLLMSource, encoder: PairEncoder) -> str:
    """The cache name of ``source``'s reference log-probabilities under ``run`` (module docstring)."""
    specs = run.specs
    data, train = specs.data, specs.train
    model = model_identity(specs)
    return digest({"format": FORMAT, "recipe": run.recipe.name,
                   "source": {"path": source.path, "content": path_content(source.path),
                              "image_root": source.image_root or data.image_root},
                   "encoder": encoder.fingerprint(),
                   "model": model if specs.model.pretrained else {**model, "seed": train.seed},
                   "max_seq_len": [data.max_seq_len, data.packing.max_seq_len if data.packing else None],
                   "attention": specs.attention, "mixed_precision": train.mixed_precision})


def pair_digests(pairs: list[PreferenceRecord]) -> dict[str, str]:
    """Each pair's content digest by record key; a key naming two different pairs is refused."""
    digests: dict[str, str] = {}
    origins: dict[str, str] = {}
    for pair in pairs:
        key, value = pair.record_id, digest([pair.messages, pair.rejected])
        if digests.get(key, value) != value:
            raise _duplicate(key, origins[key], pair.origin)
        digests[key], origins[key] = value, pair.origin
    return digests


def compute_source(run: Run, source: MLLMSource, encoder: PairEncoder) -> dict[str, Entry]:
    """One pass of the model as it is over ``source``'s pairs, this rank's packs of them, gathered from every rank."""
    accelerator, step, model, layout = run.accelerator, run.step, run.model, run.layout
    data = run.specs.data.eval_spec(source)
    pairs = read_pairs(data, on_bad=lambda err: None)  # the training or eval set counts and reports them
    digests = pair_digests(pairs)
    micro_batch_size = run.specs.train.micro_batch_size
    dataset = MLLMDataKit.build_dataset(data, encoder, rank=layout.dp_rank, world_size=layout.dp_size,
                                        records=pairs, micro_batch_size=micro_batch_size)
    dataset.plan(0)
    dataset.set_epoch(0)
    # its own generator: the pass must not draw from the global RNG the training then continues on
    loader = DataLoader(dataset, batch_size=micro_batch_size, collate_fn=run.collator,
                        generator=torch.Generator().manual_seed(0))
    rows = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                batch.pop("bad_records", None)
                batch = send_to_device(batch, accelerator.device)
                with accelerator.autocast():
                    logps = batch_pair_logprobs(model, batch, step.forward, step.forward_autocast(model),
                                                step.train.loss_chunk_tokens)[0]
                keys = [key for row in batch["sample_ids"] for key in row]
                values = torch.stack([logps.chosen, logps.rejected, logps.chosen_tokens, logps.rejected_tokens], 1)
                if len(keys) != len(values):
                    raise RuntimeError(f"a batch of {len(values)} pairs names {len(keys)} samples")
                rows.extend(zip(keys, values.double().cpu().tolist()))
    finally:
        model.train(was_training)
    every = gather_object(rows) if accelerator.num_processes > 1 else rows
    return {key: (digests[key], *values) for key, values in every}


def _read(path: Path) -> dict[str, Entry] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {key: tuple(entry) for key, entry in stored["entries"].items()} if stored.get("format") == FORMAT else None


def _write(path: Path, entries: dict[str, Entry]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"format": FORMAT, "entries": entries}))
    os.replace(partial, path)


def _from_rank0(value):
    """``value`` as rank 0 has it, on every rank."""
    return broadcast_object_list([value], from_process=0)[0] if torch.distributed.is_initialized() else value


def precomputed_reference(run: Run) -> tuple[ReferenceTable, dict]:
    """The reference table over every training and eval source (each read from the cache or computed, then cached)
    and what was done: ``{"computed": sources, "read": sources, "pairs": pairs}``, printed per source on rank 0."""
    accelerator, data = run.accelerator, run.specs.data
    encoder = PairEncoder(run.encoder, run.specs.dpo.shared_prefix)
    folder = Path(data.cache_dir or default_cache_dir()) / CACHE_FOLDER
    table, report, seen = ReferenceTable(), {"computed": 0, "read": 0, "pairs": 0}, set()
    for source in [*data.source_entries(), *data.eval_source_entries()]:
        fingerprint = source_fingerprint(run, source, encoder)
        if fingerprint in seen:  # the same file as a training and an eval source
            continue
        seen.add(fingerprint)
        path = folder / f"{fingerprint}.json"
        entries = _from_rank0(_read(path) if accelerator.is_main_process else None)
        if entries is None:
            started = time.perf_counter()
            entries = compute_source(run, source, encoder)
            if accelerator.is_main_process:
                _write(path, entries)
            report["computed"] += 1
            said = f"computed in one pass ({time.perf_counter() - started:.1f} s), cached in"
        else:
            report["read"] += 1
            said = "read from the cache"
        accelerator.print(f"dpo reference: {source.name}: {len(entries)} pairs' log-probabilities {said} {path}")
        table.add(entries, source.name)
    report["pairs"] = len(table.entries)
    return table, report


def attach_precomputed_reference(run: Run) -> dict | None:
    """Under ``dpo.reference=precomputed``, before the first step (the model as it starts, also on a resume: the
    checkpoint is loaded after): the run's objective looks its pairs up in the table; returns the report (None
    under any other reference)."""
    objective = run.step.objective if run.step is not None else None
    if objective is None or not objective.spec.needs_reference or objective.spec.reference != "precomputed":
        return None
    objective.lookup, report = precomputed_reference(run)
    return report
