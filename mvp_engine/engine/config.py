"""Structured configs of a training run and their conversion from Hydra, failing early with one clear line."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mvp_engine.kit.mllm.data import MLLMDataSpec, MLLMPackingAssembler, MLLMPackingSpec

from .loss import REDUCTIONS

ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flex_attention", "flash_attention_2", "flash_attention_3")
# The Hydra config root: conf/<recipe>.yaml is each recipe's primary config.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


@dataclass
class TrainSpec:
    """Optimisation and bookkeeping knobs of ``conf/train/*.yaml``."""

    epochs: int = 1
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    loss_reduction: str = "token"
    drop_last: bool = False
    pad_to_multiple_of: int | None = None
    num_workers: int = 0
    seed: int = 0
    log_every: int = 1
    mixed_precision: str = "no"
    output_dir: str | None = None  # None: outputs/run (Hydra runs fill in their run directory)

    def __post_init__(self) -> None:
        for name in ("epochs", "micro_batch_size", "gradient_accumulation_steps", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} is invalid: allowed an int >= 1")
        if self.loss_reduction not in REDUCTIONS:
            raise ConfigError(f"train.loss_reduction={self.loss_reduction!r} is invalid: allowed one of "
                              f"{list(REDUCTIONS)}")
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate={self.learning_rate!r} is invalid: allowed a float > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio!r} is invalid: allowed [0, 1)")
        if self.num_workers < 0:
            raise ConfigError(f"train.num_workers={self.num_workers!r} is invalid: allowed an int >= 0")


@dataclass
class DemoSpec:
    """The embedded demo data set, written to ``out_dir`` on first use when ``data.sources`` is empty."""

    enabled: bool = True
    out_dir: str = ".cache/demo"
    num_samples: int = 600
    seed: int = 0


@dataclass
class RunSpecs:
    """Everything a run needs, validated."""

    data: MLLMDataSpec
    demo: DemoSpec
    train: TrainSpec
    attention: str


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(group="train", name="train_schema", node=TrainSpec)
    cs.store(group="demo", name="demo_schema", node=DemoSpec)


def check_attention(name: str, supported: tuple[str, ...], training: bool = True) -> None:
    """A backend this recipe and this machine can run (train with, unless ``training=False``: forward only), or one
    line saying why not."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention.implementation={name!r} is unknown: allowed one of {list(ATTENTION_BACKENDS)}")
    if name not in supported:
        raise ConfigError(f"attention.implementation={name!r} is not supported here: allowed {list(supported)}")
    if name == "flex_attention" and training and not torch.cuda.is_available():
        raise ConfigError(f"attention.implementation={name!r} needs a CUDA GPU to train: torch's FlexAttention has no "
                          "CPU backward (forward-only checks run on CPU)")
    if name.startswith("flash_attention"):
        package = "flash_attn_interface" if name.endswith("3") else "flash_attn"
        if not torch.cuda.is_available() or importlib.util.find_spec(package) is None:
            raise ConfigError(f"attention.implementation={name!r} needs a CUDA GPU and the {package} package")


def _to_object(node: DictConfig, schema: type, key: str):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node, resolve=True))
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf validation errors and the specs' own ValueErrors
        message = str(err).splitlines()[0]
        if not message.startswith(key):
            message = f"{key}: {message}"
        raise ConfigError(message) from None


def resolve_run_specs(cfg: DictConfig, supported_attention: tuple[str, ...]) -> RunSpecs:
    """Validate the composed config; packing is present only when ``+packing=...`` was given."""
    packing_node = cfg.get("packing")
    packing = None if packing_node is None else _to_object(packing_node, MLLMPackingSpec, "packing")
    data = _to_object(cfg.data, MLLMDataSpec, "data")
    data.packing = packing
    try:
        MLLMPackingAssembler.from_spec(data.effective_packing())  # a bad assembler_cls fails here, not mid-run
    except ValueError as err:
        raise ConfigError(str(err)) from None
    demo = _to_object(cfg.demo, DemoSpec, "demo")
    if not data.sources and not demo.enabled:
        raise ConfigError("data.sources is empty and demo.enabled=false: nothing to train on")
    for source in data.sources:
        if not Path(source).is_file():
            raise ConfigError(f"data.sources: {source!r} is not a file")
    train = _to_object(cfg.train, TrainSpec, "train")
    attention = str(cfg.attention.implementation)
    check_attention(attention, supported_attention)
    return RunSpecs(data=data, demo=demo, train=train, attention=attention)


register_configs()
