"""Model and processor building that every recipe shares: a ``save_pretrained`` folder, or a tiny seeded init.

No hub is reachable, so a recipe's default model is tiny and randomly initialised from a YAML config, with its
vocabulary and special-token ids taken from a committed tokenizer asset (``tools/build_tokenizer_assets.py``);
``pretrained=<dir>`` loads a ``save_pretrained`` folder (model, tokenizer, image processor) instead. A recipe
supplies its model class, its image-processor class and a function from (model cfg, tokenizer) to the model config.

Images go through transformers' PIL image processors (the torchvision-free backend); the multimodal ``*Processor``
classes are not used because several insist on a video processor, which needs torchvision. ``ProcessorBundle``
holds the tokenizer and the image processor instead and saves both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from mvp_engine.kit.mllm.data.video_patches import GridPatchVideoProcessor

from .config import model_spec

_WITHOUT_WEIGHTS: ContextVar[bool] = ContextVar("pretrained_without_weights", default=False)


def to_plain(cfg: Any) -> Any:
    """A Hydra ``DictConfig`` / nested mapping as plain dicts and lists (None stays None)."""
    if cfg is None:
        return None
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    return cfg


@dataclass
class ProcessorBundle:
    """Tokenizer + PIL image processor, with the special-token ids the encoder and the model config need.

    A recipe subclasses it to set ``image_token`` (the placeholder its chat template renders per image) and, where
    its model takes videos, a default ``video_processor`` (saved beside the others; a grid-patch tower's:
    :func:`grid_video_processor`).
    """

    tokenizer: PreTrainedTokenizerBase
    image_processor: Any
    image_token: str = "<image>"
    video_processor: Any = None

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id and token != self.tokenizer.unk_token:
            raise ValueError(f"tokenizer has no {token!r} token; rebuild it with tools/build_tokenizer_assets.py")
        return int(token_id)

    @property
    def image_token_id(self) -> int:
        return self.token_id(self.image_token)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def save_pretrained(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        if self.video_processor is not None:
            self.video_processor.save_pretrained(directory)


def tokenizer_dir(cfg: Mapping, default: Path) -> str:
    """``cfg.pretrained`` if set, else ``cfg.tokenizer_dir``, else the recipe's committed asset."""
    return str(cfg.get("pretrained") or cfg.get("tokenizer_dir") or default)


def build_processor_bundle(bundle_cls: Callable[..., ProcessorBundle], model_cfg: Mapping | None,
                           image_processor_cls, default_tokenizer_dir: Path, **image_kwargs) -> ProcessorBundle:
    """Tokenizer and image processor from ``model_cfg.pretrained`` if set (its saved preprocessor config wins),
    else the tokenizer asset and ``image_processor_cls(**image_kwargs)``."""
    cfg = to_plain(model_cfg) or {}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg, default_tokenizer_dir))
    if cfg.get("pretrained"):
        return bundle_cls(tokenizer, image_processor_cls.from_pretrained(cfg["pretrained"]))
    return bundle_cls(tokenizer, image_processor_cls(**image_kwargs))


def grid_video_processor(model_cfg: Mapping | None, video: GridPatchVideoProcessor, image_processor,
                         settings: tuple[str, ...]) -> GridPatchVideoProcessor:
    """A grid-patch tower's video processor, its patch, merge and temporal patch sizes, mean and std taken from
    ``image_processor`` so images and videos meet the tower alike: what ``model_cfg.pretrained`` saved (``video``'s
    class, its defaults where the folder saved no video config), else ``video`` with the ``model.video_<key>``
    overrides of each key in ``settings``."""
    cfg = to_plain(model_cfg) or {}
    patches = {"patch_size": int(image_processor.patch_size), "merge_size": int(image_processor.merge_size),
               "temporal_patch_size": int(image_processor.temporal_patch_size),
               "image_mean": tuple(image_processor.image_mean), "image_std": tuple(image_processor.image_std)}
    if cfg.get("pretrained"):
        return type(video).from_pretrained(cfg["pretrained"], **patches)
    return replace(video, **patches, **{key: cfg[f"video_{key}"] for key in settings if cfg.get(f"video_{key}")})


def build_hf_model(model_cls, model_cfg: Mapping | None, attn_implementation: str | dict,
                   make_config: Callable[[dict, PreTrainedTokenizerBase], Any], default_tokenizer_dir: Path):
    """``model_cls.from_pretrained(model_cfg.pretrained)`` or a tiny seeded random init of
    ``make_config(model_cfg, tokenizer)``.

    Keys read through the validated ``ModelSpec`` (``config.model_spec``, what the engine reads too):
    ``pretrained``, ``tokenizer_dir``, ``seed``, ``dtype``; ``make_config`` reads the rest (usually ``config``).
    """
    cfg = to_plain(model_cfg) or {}
    spec = model_spec(cfg)
    dtype = getattr(torch, spec.dtype)
    if spec.pretrained and _WITHOUT_WEIGHTS.get():
        with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not loaded
            model = model_cls._from_config(AutoConfig.from_pretrained(spec.pretrained),
                                           attn_implementation=attn_implementation, dtype=dtype)
        model.tie_weights()  # the meta build leaves tied weights (Gemma's lm_head) apart: one FSDP2 unit too many
        return model
    if spec.pretrained:
        return model_cls.from_pretrained(spec.pretrained, attn_implementation=attn_implementation, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg, default_tokenizer_dir))
    config = make_config(cfg, tokenizer)
    # fork_rng: the seeded init must not move the caller's global RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return model_cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)


@contextmanager
def pretrained_without_weights() -> Iterator[None]:
    """Inside, :func:`build_hf_model` builds a ``pretrained`` model from its config alone, parameters on the meta
    device: the ranks of a sharded run that receive their shards from rank 0 (``sharding.load_full_state_dict``)
    read no weights, so host memory does not grow with ranks x model."""
    token = _WITHOUT_WEIGHTS.set(True)
    try:
        yield
    finally:
        _WITHOUT_WEIGHTS.reset(token)
