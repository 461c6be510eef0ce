"""One line for a config key or value that Hydra or OmegaConf refuses: the full key, what it allows, and for a
misspelled key the closest valid ones.

Why: their own messages span several lines, name the schema class (``object_type=TrainSpec``), answer a misspelled
key with ``To append to your config use +train.learnin_rate=...`` (which only fails later, in the spec), and once a
spec re-raised them they had lost the key (``train: Value 'abc' of type 'str' could not be converted to Integer``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

SCHEMA_SUFFIX = "_schema"  # ConfigStore schemas sit beside a group's options (register_configs); no one picks them
TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool (true or false)", str: "a string", list: "a list",
              dict: "a mapping"}


def omegaconf_error_line(err: OmegaConfBaseException, section: str = "") -> str | None:
    """The line for a wrong type or an unknown key, or None for another OmegaConf error. ``section``: the key of
    the node ``err`` was raised under when its ``full_key`` is relative to it (a spec built from ``cfg.train``)."""
    key = ".".join(part for part in (section, str(err.full_key or err.key or "")) if part)
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and "not in" in str(err):
        return _unknown_key_line(err, key)
    if isinstance(err, ValidationError) and err.key is not None:
        allowed = _allowed(err.object_type, str(err.key))
        if allowed:
            return f"{key}: {err.value!r} is not {allowed}"
    return None


def hydra_error_line(err: HydraException | OmegaConfBaseException, recipes: list[str]) -> str:
    """The line for an error Hydra raised while composing the config (before the run starts); ``recipes``: the
    primary configs ``--config-name`` may pick."""
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if isinstance(cause, OmegaConfBaseException) and (line := omegaconf_error_line(cause)):
        return line
    if isinstance(err, MissingConfigException):
        if err.options is not None:
            group, _, name = str(err.missing_cfg_file).rpartition("/")
            options = [option for option in err.options if not option.endswith(SCHEMA_SUFFIX)]
            return f"{group}={name} is not an option of {group}: allowed {', '.join(options)}"
        if "primary config" in str(err):
            return f"--config-name={err.missing_cfg_file} is not a recipe's config: allowed {', '.join(recipes)}"
    lines = []
    for line in str(err).splitlines():
        if line.startswith("Config search path"):
            break
        lines.append(line.strip())
    if isinstance(cause, OmegaConfBaseException):
        lines.append(str(cause).splitlines()[0])
    return " ".join(line for line in lines if line)


def _unknown_key_line(err: OmegaConfBaseException, key: str) -> str:
    """``train.learnin_rate is not a config key: did you mean train.learning_rate?``; with no close key, the keys
    there are, and outside a schema's node (which takes no other key) that ``+key=value`` adds one."""
    schema = err.object_type if dataclasses.is_dataclass(err.object_type) else None
    if schema is not None:
        valid = [f.name for f in dataclasses.fields(schema)]
    else:
        valid = [str(name) for name in (err.parent_node.keys() if err.parent_node is not None else ())]
    parent = key.rpartition(".")[0]
    place = f"{parent}." if parent else ""
    close = difflib.get_close_matches(str(err.key), valid, n=3, cutoff=0.6)
    if close:
        return f"{key} is not a config key: did you mean {' or '.join(place + name for name in close)}?"
    adding = "" if schema is not None else f" (a new key: +{key}=VALUE)"
    return f"{key} is not a config key: {parent or 'the config'} has {', '.join(valid)}{adding}"


def _allowed(schema: type | None, name: str) -> str | None:
    """What a field of ``schema`` holds, in words (``an int``, ``a float or null``), from its type hint."""
    if not dataclasses.is_dataclass(schema):
        return None
    hint = typing.get_type_hints(schema).get(name)
    return None if hint is None else _type_words(hint)


def _type_words(hint) -> str | None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        words = [_type_words(member) for member in members if member is not type(None)]
        if None in words:
            return None
        return " or ".join(words) + (" or null" if type(None) in members else "")
    return TYPE_NAMES.get(origin or hint)
