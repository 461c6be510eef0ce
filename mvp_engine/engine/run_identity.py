"""What a run is, recorded in every checkpoint, so that a resume continues the run that wrote it or refuses.

Why: a checkpoint holds a position (optimizer steps into an epoch's plan) and a schedule (the lr over the run's
total steps). Both mean something only for the data and the settings they were made with: records appended to a
source move every later pack, so the position skips samples the new plan puts first; another learning rate, another
number of epochs (the schedule's total) or another data set train something else under the old run's name.

The identity is every setting of the run's validated specs (deny by default: a setting added later is covered
without a word here), less :data:`ELASTIC`, the settings that leave the training math alone; plus the recipe, each
source by name with its path and content fingerprint (``store.content_identity``: what a faithful copy keeps, so
data staged again with ``rsync -a`` still resumes), and the model's folders by path and content. World size,
micro-batch and accumulation are checked as a split of the same global batch by ``RunState.check_resume``, not
here.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from mvp_engine.kit.mllm.data import MLLMDataSpec
from mvp_engine.kit.mllm.data.shards import is_pattern, shard_files
from mvp_engine.kit.mllm.data.store import content_identity, digest

from .config import ConfigError, RunSpecs

# settings a resume may change, with why the run stays the same run (the table in README.md and skills/)
ELASTIC = {
    # the global batch split (RunState.check_resume): packs go to steps before ranks
    "train.micro_batch_size", "train.gradient_accumulation_steps", "train.context_parallel_size",
    # where and how often the run reports and saves
    "train.output_dir", "train.resume_from", "train.save_every_steps", "train.keep_last", "train.log_every",
    "train.report_to", "train.eval_every_steps", "train.peak_tflops", "train.time_barrier",
    # how the same math is laid out: loader processes, sharding (DCP reshards), when FSDP2 reduce-scatters,
    # recomputation
    "train.num_workers", "train.num_threads", "train.sharding", "train.grad_sync", "train.activation_checkpointing",
    "attention", "train.offload",
    # how long a collective waits; and whether kernels repeat bit for bit: deterministic kernels compute the same
    # objective in a fixed order (a nondeterministic run already differs in its last bits from run to run), so
    # switching it on to check a resumed run is the same run
    "train.dist_timeout_s", "train.deterministic",
    # how the loss is computed: the chunked loss is the full logits' cross-entropy over the same weights, only
    # projected a chunk of supervised positions at a time (tests/test_linear_loss.py), so a run may switch on resume
    "train.loss_impl", "train.loss_chunk_tokens",
    # where and how lengths are measured (the cache keys on content), and whether bad records stop the run
    "data.cache_dir", "data.measure_cache", "data.measure_workers", "data.on_bad_record", "data.max_bad_fraction",
    # the format of the final save, not what is trained
    "model.lora.merge_on_save",
}
SCHEDULE_NOTE = "(the lr schedule spans the run's total steps: another total would make it jump)"


def run_identity(recipe: str, specs: RunSpecs) -> dict[str, Any]:
    """The identity of a training run of ``recipe`` with ``specs``: JSON-able, compared key by key on resume.
    The demo settings are left out: the demo set they write is a source like any other."""
    data = specs.data
    settings = {"recipe": recipe, "attention": specs.attention,
                "train": asdict(specs.train), "model": model_identity(specs), "packing": _plain(data.packing),
                **({"dpo": asdict(specs.dpo)} if specs.dpo is not None else {}),
                "data": {k: v for k, v in asdict(data).items() if k not in ("sources", "eval_sources", "packing")}}
    identity = {key: value for key, value in _flat(settings).items() if key not in ELASTIC}
    identity["data.sources"] = _sources(data.source_entries(), data)
    identity["data.eval_sources"] = _sources(data.eval_source_entries(), data)
    return identity


def setting_defaults(specs: RunSpecs) -> dict[str, Any]:
    """Each setting's default, flattened as in :func:`run_identity`: a setting the checkpoint's version did not have
    yet counts as unchanged while this run leaves it at its default."""
    sections = {"train": specs.train, "model": specs.model, "data": specs.data, "packing": specs.data.packing}
    return _flat({name: {f.name: f.default if f.default is not MISSING else f.default_factory()
                         for f in fields(spec) if f.default is not MISSING or f.default_factory is not MISSING}
                  for name, spec in sections.items() if spec is not None})


def check_identity(saved: dict | None, current: dict, checkpoint: Path, defaults: dict | None = None) -> str | None:
    """Nothing when ``checkpoint`` was saved by this run; one ``ConfigError`` line naming every change otherwise.
    A checkpoint from before identities were recorded (``saved`` None): the warning to print. ``defaults``
    (:func:`setting_defaults`): a setting newer than the checkpoint, left at its default, is no change."""
    if saved is None:
        return (f"warning: train.resume_from: {checkpoint} was saved before checkpoints recorded their run: its data "
                "and settings cannot be checked against this run's (its next checkpoint records them)")
    defaults = defaults or {}
    changed = [key for key in dict.fromkeys([*saved, *current]) if saved.get(key, _UNSET) != current.get(key, _UNSET)
               and not (_newer_than(saved, key) and current.get(key, _UNSET) == defaults.get(key, _UNSET))]
    # a group set on one side only (packing off -> on, an empty model.config): one change, not one per key in it
    groups = {key for key in changed if any(other.startswith(f"{key}.") for other in changed)}
    changes = [f"{key} {_shown(saved, key)} -> {_shown(current, key)}" if key in groups else
               _change(key, saved.get(key, _UNSET), current.get(key, _UNSET))
               for key in changed if not any(key.startswith(f"{group}.") for group in groups)]
    if changes:
        raise ConfigError(f"train.resume_from: {checkpoint} was saved by another run: {'; '.join(changes)}: "
                          "restore the settings and data it was saved with, or start a fresh run in another "
                          "train.output_dir")
    return None


_UNSET = object()


def _newer_than(saved: dict, key: str) -> bool:
    """``key`` is a setting the saved identity does not know at all (not a group switched on or off there)."""
    return key not in saved and not any(key.startswith(f"{other}.") or other.startswith(f"{key}.") for other in saved)


def _flat(node: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 2}}`` -> ``{"train.epochs": 2}``; an empty mapping stays one value."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = _plain(value)
    return flat


def _plain(value: Any) -> Any:
    """JSON's view of a setting: dataclasses as mappings, classes by dotted path (``packing.assembler_cls``)."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if hasattr(value, "__dataclass_fields__"):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def model_identity(specs: RunSpecs) -> dict:
    """``model.*``, its folders (``pretrained``, ``tokenizer_dir``) by path and content (also what the cache of
    precomputed reference log-probabilities keys on, ``reference_logps.py``)."""
    model = asdict(specs.model)
    extra = model.pop("extra")
    for key in ("pretrained", "tokenizer_dir"):
        if model[key]:
            path = os.path.abspath(model[key]) if os.path.exists(model[key]) else model[key]
            model[key] = {"path": path, "content": path_content(model[key])}
    return {**extra, **model}


def _sources(entries, data: MLLMDataSpec) -> list[dict]:
    """Each source in order (the plan numbers records source after source): name, path, image root, repeat and a
    fingerprint of its content."""
    return [{"name": entry.name, "path": os.path.abspath(entry.path), "repeat": entry.repeat,
             "image_root": entry.image_root or data.image_root, "content": path_content(entry.path)}
            for entry in entries]


def path_content(path: str) -> str | None:
    """A file's :func:`content_identity`; of every file under a folder (a saved data set, a model folder), by name
    relative to it; of every shard a pattern matches (a shard source: a shard added, gone or changed moves the
    plan); None for a name that is no path (a hub name: the name is all there is)."""
    if os.path.isfile(path):
        return digest(content_identity(path))
    if not os.path.isdir(path):
        shards = shard_files(path) if is_pattern(path) else None
        return None if shards is None else digest([[f, content_identity(f)] for f in shards[1]])
    files = sorted(Path(root) / name for root, _, names in os.walk(path) for name in names)
    return digest([[str(p.relative_to(path)), content_identity(p)] for p in files])


def _show(value: Any) -> str:
    if value is _UNSET:
        return "unset"
    return value["path"] if isinstance(value, dict) and "path" in value else json.dumps(value)


def _shown(identity: dict, group: str) -> str:
    return json.dumps(identity[group]) if group in identity else "set"


def _change(key: str, old: Any, new: Any) -> str:
    if key in ("data.sources", "data.eval_sources"):
        return _source_changes("data source" if key == "data.sources" else "eval source", old, new)
    if isinstance(old, dict) and isinstance(new, dict) and old.get("path", 0) == new.get("path", 1):
        return f"{key} {old['path']} changed (its files were rewritten)"
    line = f"{key} {_show(old)} -> {_show(new)}"
    return f"{line} {SCHEDULE_NOTE}" if key == "train.epochs" else line


def _source_changes(kind: str, old: Any, new: Any) -> str:
    old = {} if old is _UNSET else {source["name"]: source for source in old}
    new = {} if new is _UNSET else {source["name"]: source for source in new}
    changes = [f"{kind} {name!r} removed" for name in old if name not in new]
    changes += [f"{kind} {name!r} added" for name in new if name not in old]
    for name in (n for n in new if n in old and new[n] != old[n]):
        before, after = old[name], new[name]
        if before["path"] != after["path"]:
            changes.append(f"{kind} {name!r} is another file: {before['path']} -> {after['path']}")
            continue
        changes += [f"{kind} {name!r} {field} {_show(before[field])} -> {_show(after[field])}"
                    for field in ("repeat", "image_root") if before[field] != after[field]]
        if before["content"] != after["content"]:
            changes.append(f"{kind} {name!r} changed (records appended or rewritten)")
    order = [[n for n in names if n in old and n in new] for names in (old, new)]
    if not changes and order[0] != order[1]:
        changes.append(f"{kind}s reordered: {', '.join(order[0])} -> {', '.join(order[1])}")
    return "; ".join(changes)
