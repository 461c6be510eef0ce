"""A ``model.pretrained`` folder, checked before anything is built from it: one line naming the folder and what is
wrong with it.

Why: transformers reads a folder piecemeal and late, and each gap surfaces far from its cause, as a traceback with
advice about something else. Measured (transformers 5.24): an empty folder asks to install sentencepiece (the
tokenizer falls back to converting a slow one); a folder without ``config.json`` builds the architecture's default
configuration, a full-size model, until memory runs out; another family's folder loads, its weights "newly
initialized"; a folder without tokenizer files gives a one-token tokenizer; a truncated ``model.safetensors`` fails
deep in the loader. The checks read file names, JSON and safetensors headers, never a weight, so they cost
milliseconds for any model size.

The ``model_type`` a folder must have is the recipe's fact (``Recipe.model_types``); the engine names no family.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from peft.utils import CONFIG_NAME as ADAPTER_CONFIG
from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS
from safetensors import SafetensorError, safe_open
from transformers.tokenization_utils_base import FULL_TOKENIZER_FILE
from transformers.utils import (
    CONFIG_NAME,
    IMAGE_PROCESSOR_NAME,
    PROCESSOR_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from .config import ConfigError

# the fast tokenizer's file, or what a slow one converts from (a sentencepiece model, a BPE vocabulary)
TOKENIZER_FILES = (FULL_TOKENIZER_FILE, "tokenizer.model", "vocab.json")
IMAGE_PROCESSOR_FILES = (IMAGE_PROCESSOR_NAME, PROCESSOR_NAME)


def check_model_folder(folder: str | Path, model_types: Sequence[str] = (), key: str = "model.pretrained") -> None:
    """``folder`` holds what a recipe builds its processor and model from: tokenizer and image-processor files,
    ``config.json`` with one of ``model_types`` (empty: any), and readable weights. A LoRA adapter folder
    (``lora.py``) holds the adapters and the processor; its model part is beside them, or in the base folder its
    ``adapter_config.json`` names (a base that is not there is ``lora.check_adapter_base``'s line)."""
    path, where = Path(folder), f"{key}={folder}"
    if not path.is_dir():
        raise ConfigError(f"{where}: {'not a folder' if path.exists() else 'no such folder'}: name a "
                          "save_pretrained folder (config.json, weights, tokenizer and image-processor files)")
    files = {p.name for p in path.iterdir()}
    if not files:
        raise ConfigError(f"{where}: the folder is empty: name a save_pretrained folder (config.json, weights, "
                          "tokenizer and image-processor files)")
    _require_one_of(files, TOKENIZER_FILES, "tokenizer file", where)
    _require_one_of(files, IMAGE_PROCESSOR_FILES, "image-processor file", where)
    if ADAPTER_CONFIG in files:
        _check_safetensors(path / ADAPTER_WEIGHTS, where, named_by=ADAPTER_CONFIG)
        if CONFIG_NAME not in files:
            base = _read_json(path / ADAPTER_CONFIG, where).get("base_model_name_or_path")
            if not base or not Path(base).is_dir():
                return
            path, where = Path(base), f"{where} (its base {base})"
            files = {p.name for p in path.iterdir()}
    _check_model(path, files, model_types, where)


def _check_model(path: Path, files: set[str], model_types: Sequence[str], where: str) -> None:
    if CONFIG_NAME not in files:
        raise ConfigError(f"{where}: no {CONFIG_NAME}: not a save_pretrained model folder (transformers would build "
                          "the architecture's default, full-size configuration)")
    model_type = _read_json(path / CONFIG_NAME, where).get("model_type")
    if not model_type:
        raise ConfigError(f"{where}: {CONFIG_NAME} names no model_type")
    if model_types and model_type not in model_types:
        raise ConfigError(f"{where}: its {CONFIG_NAME} has model_type {model_type!r}; this recipe trains "
                          f"{' or '.join(repr(t) for t in model_types)} models: name a folder of one, or train this "
                          f"one with the recipe for {model_type!r} models")
    if SAFE_WEIGHTS_INDEX_NAME in files:
        shards = sorted(set(_read_json(path / SAFE_WEIGHTS_INDEX_NAME, where).get("weight_map", {}).values()))
        if not shards:
            raise ConfigError(f"{where}: {SAFE_WEIGHTS_INDEX_NAME} names no weight file (its weight_map is empty)")
        for shard in shards:
            _check_safetensors(path / shard, where, named_by=SAFE_WEIGHTS_INDEX_NAME)
    elif SAFE_WEIGHTS_NAME in files:
        _check_safetensors(path / SAFE_WEIGHTS_NAME, where)
    elif not files & {WEIGHTS_NAME, WEIGHTS_INDEX_NAME}:  # torch pickles: only torch.load could tell, so not read
        raise ConfigError(f"{where}: no weights ({SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or {WEIGHTS_NAME})")


def _require_one_of(files: set[str], wanted: tuple[str, ...], what: str, where: str) -> None:
    if not files & set(wanted):
        raise ConfigError(f"{where}: no {what} ({' or '.join(wanted)}): save the processor into the folder too "
                          "(processor.save_pretrained)")


def _read_json(file: Path, where: str) -> dict:
    try:
        content = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{where}: {file.name} cannot be read as JSON ({err})") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{where}: {file.name} holds a JSON {type(content).__name__}, not an object")
    return content


def _check_safetensors(file: Path, where: str, named_by: str | None = None) -> None:
    """The header parses and every tensor's byte range lies inside the file (``safe_open`` checks both; no tensor
    is read)."""
    if not file.is_file():
        raise ConfigError(f"{where}: {file.name} is missing" + (f" (named in {named_by})" if named_by else ""))
    try:
        with safe_open(file, framework="pt"):
            pass
    except SafetensorError as err:
        raise ConfigError(f"{where}: {file.name} is truncated or corrupt ({err}): save or copy it again") from None
