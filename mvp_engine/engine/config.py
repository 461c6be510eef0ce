"""Structured configs of a training run and their conversion from Hydra, failing early with one clear line.

The dataclasses here (and the kit's ``MLLMDataSpec`` / ``MLLMPackingSpec``) are the one home of every default. They
are registered in Hydra's ConfigStore as schemas (``register_configs``) that the group files under ``conf/`` extend
through their ``defaults:`` list, so a group file holds only what that group deliberately changes, and a plain
``train.epochs=2`` (no ``+``) reaches every field. ``tests/test_config_defaults.py`` lists those changes.
"""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from transformers import SchedulerType

from mvp_engine.kit.mllm.data import (
    MLLMDataSpec,
    MLLMPackingAssembler,
    MLLMPackingSpec,
    MLLMRecordError,
    source_kind,
    stream_packing_problem,
)
from mvp_engine.packing import ATTENTION_BACKENDS, BACKENDS, FLASH_BACKENDS, SDPA_VARLEN

from . import run_dir  # noqa: F401  (registers the ${run_stamp:...} resolver the configs use)
from .config_errors import omegaconf_error_line
from .device import cuda_in_use
from .loss import REDUCTIONS
from .trackers import check_report_to

AUTO_ATTENTION = "auto"  # resolved per machine and run kind by resolve_attention
AUTO_THREADS = "auto"  # train.num_threads: this process's share of the cores (launch.threads_for)
AUTO_WORKERS = "auto"  # train.num_workers: loader processes from this process's share of the cores (launch.workers_for)
GRAD_SYNCS = ("every", "last")  # train.grad_sync: which micro-batches FSDP2 reduce-scatters gradients after
# train.loss_impl: chunked projects the supervised positions a chunk at a time (linear_loss.py); full takes the
# model's whole logits (loss.py), the reference the chunked path is tested against
LOSS_IMPLS = ("chunked", "full", "liger", "cce")
GPU_LOSS_IMPLS = ("liger", "cce")  # fused Triton kernels of optional packages (gpu_losses.py): CUDA only
AUTO_PRECISION = "auto"  # train.mixed_precision: bf16 on CUDA, no on the CPU (resolve_mixed_precision)
MIXED_PRECISION = ("no", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HALF_DTYPES = tuple(AUTOCAST_DTYPES.values())  # what flash attention kernels compute in
SHARDINGS = ("none", "fsdp2")  # train.sharding (mvp_engine.engine.sharding)
# train.offload: params puts FSDP2's shards, their gradients and the optimizer state built over them on the host
# (torch's CPUOffloadPolicy, sharding.py); optimizer keeps AdamW's state and update on the host, the parameters and
# gradients on the device (host_optimizer.py)
OFFLOADS = ("none", "params", "optimizer")
# model.quantization: the base's linear layers in 4-bit NF4 or 8-bit (bitsandbytes) under LoRA adapters (quantize.py)
QUANTIZATIONS = ("none", "nf4", "int8")
OBJECTIVES = ("sft", "dpo")  # train.objective: dpo trains on preference pairs (preference.py)
# train.router_aux_loss_scope: over what the load-balancing loss's expert fractions are counted (router_balance.py)
ROUTER_AUX_SCOPES = ("step", "micro_batch")
ROUTER_AUX_LAYERS = ("pooled", "per_layer")  # train.router_aux_loss_layers: transformers' form, or per layer
# The Hydra config root: conf/<recipe>.yaml is each recipe's primary config.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


@dataclass
class TrainSpec:
    """Optimisation and bookkeeping knobs of ``conf/train/*.yaml``: the defaults of every run, command line or
    library (``conf/train/default.yaml`` only adds the Hydra run directory as ``output_dir``)."""

    epochs: int = 3
    # optimizer steps of a stream-mode run (data.streaming=true), which has no epochs to plan from; 0: none (an
    # indexed run's steps are planned from epochs)
    max_steps: int = 0
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    loss_reduction: str = "token"
    loss_impl: str = "chunked"  # chunked or full (LOSS_IMPLS)
    objective: str = "sft"  # sft, or dpo: preference pairs and the dpo.* losses (preference.py)
    loss_chunk_tokens: int = 512  # positions the chunked loss projects at once: its peak is ~8 bytes x this x vocab
    drop_last: bool = False
    pad_to_multiple_of: int | None = None  # null: the longest row; flex_attention: a few widths (row_widths.py)
    num_workers: int | str = AUTO_WORKERS  # DataLoader processes decoding and collating per rank; auto: workers_for
    seed: int = 0
    log_every: int = 10  # optimizer steps between metric lines
    mixed_precision: str = AUTO_PRECISION  # no, bf16, fp16 or auto (bf16 on CUDA, no on the CPU)
    output_dir: str | None = None  # None: outputs/run (Hydra runs fill in their run directory)
    save_every_steps: int = 0  # 0: no periodic checkpoint (a SIGTERM still saves one)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted only after a newer one is complete
    resume_from: str | None = None  # null: start fresh; auto: the newest checkpoint in the run directory; or a path
    peak_tflops: float | None = None  # the device's peak for MFU; null: the GPU table (bf16/fp16) or no MFU
    time_barrier: bool = False  # time each rank's compute and its wait at a barrier before the optimizer step
    sharding: str = "none"  # none: DDP (replicated model); fsdp2: torch's FSDP2 over the ranks (sharding.py)
    activation_checkpointing: bool = False  # recompute each decoder layer and vision block in backward (recompute.py)
    context_parallel_size: int = 1  # CP ranks sharing each packed row (Ulysses; context_parallel.py); DP = world / it
    expert_parallel_size: int = 1  # ranks each MoE layer's experts are split over, all-to-all (expert_parallel.py)
    eval_every_steps: int = 0  # evaluate data.eval_sources every that many optimizer steps; 0: at the end only
    report_to: list[str] = field(default_factory=list)  # trackers: tensorboard, wandb, mlflow (trackers.py)
    num_threads: int | str = AUTO_THREADS  # torch's CPU threads per process; auto: launch.threads_for
    # how long a rank waits at a collective before the run fails: rank 0 alone reads a pretrained model under FSDP2
    # while the others wait at its broadcast, and torch's NCCL default (10 min) is shorter than reading a large one
    dist_timeout_s: int = 1800
    deterministic: bool = False  # deterministic kernels (launch.use_deterministic): CUDA runs repeat bit for bit
    # FSDP2: reduce-scatter gradients after every micro-batch (sharded accumulation, the least memory) or after the
    # last of each step only (one reduce-scatter per step; each rank keeps its units' unsharded fp32 gradients
    # until then); DDP syncs after the last either way (train_step.py)
    grad_sync: str = "every"
    # none; params (FSDP2): shards, gradients and optimizer state on the host, each unit copied to the device for
    # its forward and backward (CPUOffloadPolicy); optimizer: AdamW's state and update on the host (OFFLOADS)
    offload: str = "none"
    # mixture-of-experts models (router_balance.py): the load-balancing loss's coefficient (null: the model config's
    # where its own aux loss is on, else 0) and over what its expert fractions are counted: the whole optimizer step
    # (exact: one extra no-grad forward per micro-batch) or each micro-batch summed over the ranks
    router_aux_loss_coef: float | None = None
    router_aux_loss_scope: str = "step"
    router_aux_loss_layers: str = "pooled"  # f and P pooled over the layers (transformers'), or per layer, averaged
    # aux-loss-free balancing (router_balance.py) of a model whose routers carry a correction bias (GLM-4.5V's
    # e_score_correction_bias): each step, bias += rate x sign(mean load - expert load) from the step's counts
    # over every rank's real tokens; 0: off (the bias stays as loaded)
    router_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("epochs", "micro_batch_size", "gradient_accumulation_steps", "log_every", "keep_last",
                     "context_parallel_size", "expert_parallel_size", "dist_timeout_s", "loss_chunk_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} is invalid: allowed an int >= 1")
        for name in ("save_every_steps", "seed", "eval_every_steps", "max_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} is invalid: allowed an int >= 0")
        if self.loss_reduction not in REDUCTIONS:
            raise ConfigError(f"train.loss_reduction={self.loss_reduction!r} is invalid: allowed one of "
                              f"{list(REDUCTIONS)}")
        if self.loss_impl not in LOSS_IMPLS:
            raise ConfigError(f"train.loss_impl={self.loss_impl!r} is invalid: allowed one of {list(LOSS_IMPLS)}")
        if self.loss_impl in GPU_LOSS_IMPLS and not cuda_in_use():
            raise ConfigError(f"train.loss_impl={self.loss_impl!r} needs a CUDA GPU (its fused kernel is Triton, "
                              "which does not run on the CPU): use 'chunked', the same loss in torch")
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate={self.learning_rate!r} is invalid: allowed a float > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio!r} is invalid: allowed [0, 1)")
        if not self.weight_decay >= 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay!r} is invalid: allowed a float >= 0")
        if not self.max_grad_norm > 0:
            raise ConfigError(f"train.max_grad_norm={self.max_grad_norm!r} is invalid: allowed a float > 0")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigError(f"train.pad_to_multiple_of={self.pad_to_multiple_of!r} is invalid: allowed null or "
                              "an int >= 1")
        schedulers = [kind.value for kind in SchedulerType]
        if self.lr_scheduler not in schedulers:
            raise ConfigError(f"train.lr_scheduler={self.lr_scheduler!r} is invalid: allowed one of {schedulers}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"train.sharding={self.sharding!r} is invalid: allowed one of {list(SHARDINGS)}")
        if self.sharding == "fsdp2" and self.mixed_precision == "fp16":
            raise ConfigError("train.mixed_precision='fp16' is not supported under train.sharding=fsdp2 (its loss "
                              "scaler would not see the sharded gradients): use 'bf16'")
        if self.mixed_precision not in (*MIXED_PRECISION, AUTO_PRECISION):
            raise ConfigError(f"train.mixed_precision={self.mixed_precision!r} is invalid: allowed one of "
                              f"{[*MIXED_PRECISION, AUTO_PRECISION]}")
        if self.mixed_precision == "fp16" and not cuda_in_use():
            raise ConfigError("train.mixed_precision='fp16' needs a CUDA GPU: use 'bf16' or 'no' on the CPU")
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, (int, float)) and self.peak_tflops > 0):
            raise ConfigError(f"train.peak_tflops={self.peak_tflops!r} is invalid: allowed null or a float > 0 "
                              "(TFLOP/s of one device)")
        check_report_to(list(self.report_to))
        threads = self.num_threads
        if threads != AUTO_THREADS and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ConfigError(f"train.num_threads={threads!r} is invalid: allowed {AUTO_THREADS!r} or an int >= 1")
        workers = self.num_workers
        if workers != AUTO_WORKERS and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
            raise ConfigError(f"train.num_workers={workers!r} is invalid: allowed {AUTO_WORKERS!r} or an int >= 0")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"train.objective={self.objective!r} is invalid: allowed one of {list(OBJECTIVES)}")
        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"train.grad_sync={self.grad_sync!r} is invalid: allowed one of {list(GRAD_SYNCS)}")
        if self.offload not in OFFLOADS:
            raise ConfigError(f"train.offload={self.offload!r} is invalid: allowed one of {list(OFFLOADS)}")
        if self.offload == "params" and self.sharding != "fsdp2":
            raise ConfigError(f"train.offload={self.offload!r} offloads FSDP2's shards: set train.sharding=fsdp2")
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0):
            raise ConfigError(f"train.router_aux_loss_coef={coef!r} is invalid: allowed null or a float >= 0")
        rate = self.router_bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
            raise ConfigError(f"train.router_bias_update_rate={rate!r} is invalid: allowed a float >= 0")
        if self.router_aux_loss_layers not in ROUTER_AUX_LAYERS:
            raise ConfigError(f"train.router_aux_loss_layers={self.router_aux_loss_layers!r} is invalid: allowed one "
                              f"of {list(ROUTER_AUX_LAYERS)}")
        if self.router_aux_loss_scope not in ROUTER_AUX_SCOPES:
            raise ConfigError(f"train.router_aux_loss_scope={self.router_aux_loss_scope!r} is invalid: allowed one "
                              f"of {list(ROUTER_AUX_SCOPES)}")
        if self.resume_from not in (None, "auto") and not Path(self.resume_from).is_dir():
            raise ConfigError(f"train.resume_from={self.resume_from!r} is invalid: allowed null, 'auto' or a "
                              "checkpoint directory")


@dataclass
class DemoSpec:
    """The embedded demo data set (``mvp_engine.engine.demo``), written by an entry point's ``with_demo_data`` when
    ``data.sources`` is empty, into a folder of ``out_dir`` named by the other settings (``demo.demo_dir``)."""

    enabled: bool = True
    out_dir: str = ".cache/demo"
    num_samples: int = 600
    seed: int = 0
    videos: bool = False  # add short generated clips to the mix (a recipe whose encoder takes video sets it)


LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")  # dpo.loss_type
REFERENCES = ("adapters_off", "copy", "precomputed")  # dpo.reference


@dataclass
class PreferenceSpec:
    """``dpo.*`` (``conf/dpo/default.yaml``; the losses and the reference: ``preference.py``). Here beside the other
    specs so ``register_configs`` holds it as the dpo group's schema."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    simpo_gamma: float = 0.5
    reference: str = "adapters_off"
    shared_prefix: bool = True  # false: each answer after its own copy of the prompt (pairs.PairEncoder)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"dpo.loss_type={self.loss_type!r} is invalid: allowed one of {list(LOSS_TYPES)}")
        if self.reference not in REFERENCES:
            raise ConfigError(f"dpo.reference={self.reference!r} is invalid: allowed one of {list(REFERENCES)}")
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta={self.beta!r} is invalid: allowed a float > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing!r} is invalid: allowed [0, 0.5)")
        if self.sft_weight < 0:
            raise ConfigError(f"dpo.sft_weight={self.sft_weight!r} is invalid: allowed a float >= 0")

    @property
    def needs_reference(self) -> bool:
        return self.loss_type != "simpo"


# every linear layer of each decoder layer's attention (full or linear) and MLP
LANGUAGE_MODEL_TARGETS = ("*language_model.layers.*_attn", "*language_model.layers.*.mlp")


@dataclass
class LoraSpec:
    """``model.lora`` (``conf/model/lora/default.yaml``; the adapters themselves: ``lora.py``); ``r=0`` trains the
    model itself. Here beside the other specs so ``register_configs`` can hold it as a schema without importing
    peft."""

    r: int = 0
    alpha: float | None = None  # null: 2 x r
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LANGUAGE_MODEL_TARGETS))
    modules_to_save: list[str] = field(default_factory=list)  # trained in full beside the adapters (e.g. lm_head)
    merge_on_save: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 0:
            raise ConfigError(f"model.lora.r={self.r!r} is invalid: allowed an int >= 0 (0: no adapters)")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha={self.alpha!r} is invalid: allowed null (2 x r) or a float > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout={self.dropout!r} is invalid: allowed [0, 1)")
        for key in ("target_modules", "modules_to_save"):
            value = getattr(self, key)
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise ConfigError(f"model.lora.{key}={value!r} is invalid: allowed a list of module-name patterns")
        if self.enabled and not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name at least one module to adapt")

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.lora_alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "modules_to_save": list(self.modules_to_save),
                "merge_on_save": self.merge_on_save}

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.r


@dataclass
class ModelSpec:
    """``model.*`` as the engine reads it, validated once (:func:`model_spec`): where the weights and tokenizer come
    from, the seed and dtype of a fresh init, what to freeze, the LoRA adapters. ``config`` (a fresh model's sizes)
    and ``extra`` (every other key: the family's own, e.g. pixel bounds) belong to the recipe, whose hooks still take
    the whole ``cfg.model``."""

    pretrained: str | None = None  # a save_pretrained folder (model, tokenizer, processors)
    tokenizer_dir: str | None = None  # null: the recipe's committed tokenizer asset
    seed: int = 0  # a fresh init's (and the LoRA adapters')
    dtype: str = "float32"
    freeze: list[str] = field(default_factory=list)  # module-name patterns (fnmatch)
    lora: LoraSpec = field(default_factory=LoraSpec)
    config: dict = field(default_factory=dict)
    quantization: str = "none"  # none, nf4 or int8: the base under LoRA adapters (QUANTIZATIONS)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("pretrained", "tokenizer_dir"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"model.{key}={value!r} is invalid: allowed null or a directory")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"model.seed={self.seed!r} is invalid: allowed an int >= 0")
        if not isinstance(getattr(torch, str(self.dtype), None), torch.dtype):
            raise ConfigError(f"model.dtype={self.dtype!r} is invalid: allowed a torch dtype name (float32, "
                              "bfloat16, float16)")
        if isinstance(self.freeze, str) or not all(isinstance(p, str) for p in self.freeze):
            raise ConfigError(f"model.freeze={self.freeze!r} is invalid: allowed a list of module-name patterns")
        if not isinstance(self.config, dict):
            raise ConfigError(f"model.config={self.config!r} is invalid: allowed a mapping")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"model.quantization={self.quantization!r} is invalid: allowed one of "
                              f"{list(QUANTIZATIONS)}")
        if self.quantization != "none" and not self.lora.enabled:
            raise ConfigError(f"model.quantization={self.quantization} freezes a quantized base: train LoRA "
                              "adapters on it (model.lora.r > 0)")


def model_spec(node) -> ModelSpec:
    """The validated ``model.*`` of a composed config (a ``DictConfig`` or a plain mapping): the engine's keys, the
    rest in ``extra``; a null ``seed`` / ``dtype`` / ``freeze`` is its default, as the builders read it."""
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    lora = plain.pop("lora", None)
    engine = [f.name for f in fields(ModelSpec) if f.name not in ("lora", "extra")]
    given = {key: plain.pop(key) for key in engine if key in plain}
    return ModelSpec(**{key: value for key, value in given.items() if value is not None}, extra=plain,
                     lora=LoraSpec() if lora is None else _to_object(OmegaConf.create(lora), LoraSpec, "model.lora"))


@dataclass
class RunSpecs:
    """Everything a run needs, validated."""

    data: MLLMDataSpec
    demo: DemoSpec
    train: TrainSpec
    attention: str
    model: ModelSpec = field(default_factory=ModelSpec)
    attention_why: str = ""  # how attention was chosen (choose_attention), for the start line
    dpo: PreferenceSpec | None = None  # dpo.* when train.objective=dpo (preference.py)


def schema_without(spec: type, *left_out: str) -> type:
    """``spec``'s fields and defaults, less ``left_out``, as a plain dataclass for a config group's schema.

    Why: ``MLLMDataSpec.packing`` is set by the top-level ``packing`` group (``+packing=greedy``, filled in by
    ``resolve_run_specs``); a ``data.packing: null`` in every composed config would be a key nothing reads. The
    defaults are taken from ``spec``, never written twice; values are checked when ``resolve_run_specs`` builds the
    real spec (a schema only types the keys: OmegaConf never calls ``__post_init__`` on one)."""
    hints = typing.get_type_hints(spec)
    kept = [(f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory))
            for f in fields(spec) if f.name not in left_out]
    schema = make_dataclass(f"{spec.__name__}Schema", kept)
    schema.__module__ = __name__
    return schema


def register_configs() -> None:
    """The schemas ``conf/<group>/*.yaml`` extend (``defaults: [<group>_schema, _self_]``); the kit registers
    ``packing/packing_schema`` and ``report_config`` registers ``report/report_schema``."""
    cs = ConfigStore.instance()
    cs.store(group="train", name="train_schema", node=TrainSpec)
    cs.store(group="demo", name="demo_schema", node=DemoSpec)
    cs.store(group="data", name="data_schema", node=schema_without(MLLMDataSpec, "packing"))
    cs.store(group="model/lora", name="lora_schema", node=LoraSpec)
    cs.store(group="dpo", name="dpo_schema", node=PreferenceSpec)


def compose_config(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a ``python -m recipes.<name>.train <overrides>`` run would see (no Hydra run dir), for tools,
    tests and notebooks that compose without ``hydra.main``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def package_available(package: str) -> bool:
    """Whether ``package`` imports here. With ``cuda_in_use`` it is what the backend choice asks of the machine, so a
    test poses as a machine with CUDA and flash-attn by replacing the two."""
    return importlib.util.find_spec(package) is not None


def resolve_mixed_precision(setting: str) -> str:
    """``train.mixed_precision=auto``: ``bf16`` on CUDA (autocast over fp32 master weights: the tensor cores' rate,
    and the only precision flash attention computes in), ``no`` on the CPU (fp32, where the project's exactness
    checks run); any other value is kept. Resolved once, with the run's specs: everything after reads the result."""
    if setting != AUTO_PRECISION:
        return setting
    return "bf16" if cuda_in_use() else "no"


def compute_dtype(mixed_precision: str, model_dtype: str) -> torch.dtype:
    """The dtype attention computes in: autocast's under a resolved ``train.mixed_precision`` of bf16 / fp16 (FSDP2's
    policy casts the parameters to the same), else the weights' own ``model.dtype``."""
    return AUTOCAST_DTYPES.get(mixed_precision, getattr(torch, model_dtype))


def attention_obstacle(name: str, supported: tuple[str, ...], training: bool = True,
                       dtype: torch.dtype | None = None) -> str | None:
    """Why this recipe and this machine cannot run ``name`` (train with, unless ``training=False``: forward only)
    computing in ``dtype``, worded to follow the backend's name; None when they can. ``dtype`` None: the caller
    casts to what the backend needs (the equivalence checks run flash in bf16)."""
    if name not in ATTENTION_BACKENDS:
        return f"is unknown: allowed one of {[AUTO_ATTENTION, *ATTENTION_BACKENDS]}"
    if name not in supported:
        return f"is not supported here: allowed {list(supported)}"
    backend = BACKENDS[name]
    if backend.package is not None:
        if not cuda_in_use() or not package_available(backend.package):
            return f"needs a CUDA GPU and the {backend.package} package"
    elif backend.needs_cuda and training and not cuda_in_use():
        return "needs a CUDA GPU to train: torch's FlexAttention has no CPU backward (forward-only checks run on CPU)"
    if dtype is not None and name in FLASH_BACKENDS and dtype not in HALF_DTYPES:
        # transformers only warns at load; the kernel refuses float32 at the first step
        return (f"computes in bf16 or fp16 only, and this run computes in {str(dtype).removeprefix('torch.')}: set "
                "train.mixed_precision=bf16 (or model.dtype=bfloat16), or another attention.implementation")
    return None


def check_attention(name: str, supported: tuple[str, ...], training: bool = True,
                    dtype: torch.dtype | None = None) -> None:
    """A backend this recipe and this machine can run in ``dtype`` (:func:`attention_obstacle`), or one line saying
    why not."""
    obstacle = attention_obstacle(name, supported, training, dtype)
    if obstacle is not None:
        raise ConfigError(f"attention.implementation={name!r} {obstacle}")


def backward_available(backend: str, device: str | torch.device) -> bool:
    """Whether ``backend`` differentiates on ``device``: torch's FlexAttention has no CPU backward, everything else
    differentiates anywhere it runs. The device the model sits on decides, not whether the machine has CUDA: a CPU
    model on a GPU machine has no flex backward either."""
    return not BACKENDS[backend].needs_cuda or torch.device(device).type == "cuda"


def choose_attention(name: str, supported: tuple[str, ...], packed: bool,
                     dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The backend a run uses and why, for its start line. ``attention=auto``: the fastest exact backend this machine
    trains with in the run's compute ``dtype``, chosen per run kind. Packed runs avoid the dense L x L block mask
    (``sdpa_varlen`` costs the sum of squared segment lengths; at 4 k tokens it was 3x faster than the sdpa mask in
    ``tools/bench_long.py``); unpacked runs keep sdpa with its padding mask, what a padded transformers run uses.
    flash_attention_2 wins wherever it can run: on CUDA with flash-attn, computing in bf16 or fp16. Any other name is
    kept (``check_attention`` judges it)."""
    kind = "packed" if packed else "unpacked"
    if name != AUTO_ATTENTION:
        return name, f"{kind} run, set by attention.implementation"
    preferred = ("flash_attention_2", SDPA_VARLEN, "sdpa") if packed else ("flash_attention_2", "sdpa")
    offered = [candidate for candidate in preferred if candidate in supported]
    computing = "" if dtype is None else f" computing in {str(dtype).removeprefix('torch.')}"
    skipped = []
    for candidate in offered:
        obstacle = attention_obstacle(candidate, supported, dtype=dtype)
        if obstacle is None:
            why = "; ".join(skipped) or f"the first of {', '.join(offered)} it can train with"
            return candidate, f"{kind} run{computing}, auto: {why}"
        skipped.append(f"{candidate} {obstacle}")
    raise ConfigError(f"attention.implementation=auto found no backend to train with among {list(supported)}")


def resolve_attention(name: str, supported: tuple[str, ...], packed: bool, dtype: torch.dtype | None = None) -> str:
    """The backend :func:`choose_attention` chooses."""
    return choose_attention(name, supported, packed, dtype)[0]


def _to_object(node: DictConfig, schema: type, key: str):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node, resolve=True))
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as err:  # a value of the wrong type or an unknown key: named in full
        line = omegaconf_error_line(err, key)
        raise ConfigError(line or f"{key}: {str(err).splitlines()[0]}") from None
    except Exception as err:  # the specs' own ValueErrors
        message = str(err).splitlines()[0]
        if not message.startswith(key):
            message = f"{key}: {message}"
        raise ConfigError(message) from None


def demo_spec(cfg: DictConfig) -> DemoSpec:
    """The validated ``demo.*`` of a composed config."""
    return _to_object(cfg.demo, DemoSpec, "demo")


def train_spec(cfg: DictConfig) -> TrainSpec:
    """The validated ``train.*`` of a composed config."""
    return _to_object(cfg.train, TrainSpec, "train")


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
    demo = demo_spec(cfg)
    if not data.sources and not demo.enabled:
        raise ConfigError("data.sources is empty and demo.enabled=false: nothing to train on")
    for source in data.source_entries():
        try:
            source_kind(source.path)  # the kit decides what a source is: a missing or unreadable one stops here
        except MLLMRecordError as err:
            raise ConfigError(f"data.sources: {err}") from None
    for source in data.eval_source_entries():
        try:
            source_kind(source.path)
        except MLLMRecordError as err:
            raise ConfigError(f"data.eval_sources: {err}") from None
    train, model = train_spec(cfg), model_spec(cfg.get("model"))
    check_stream_mode(data, train)
    train.mixed_precision = resolve_mixed_precision(train.mixed_precision)
    dtype = compute_dtype(train.mixed_precision, model.dtype)
    attention, why = choose_attention(str(cfg.attention.implementation), supported_attention, packing is not None,
                                      dtype)
    check_attention(attention, supported_attention, dtype=dtype)
    dpo = None
    if train.objective == "dpo":
        dpo = _to_object(cfg.dpo, PreferenceSpec, "dpo") if cfg.get("dpo") is not None else PreferenceSpec()
    return RunSpecs(data=data, demo=demo, train=train, attention=attention, model=model, attention_why=why, dpo=dpo)


def check_stream_mode(data: MLLMDataSpec, train: TrainSpec) -> None:
    """``data.streaming=true`` needs the run's length (``train.max_steps``: a stream has no epochs to plan from) and
    greedy packing; ``train.max_steps`` means nothing to an indexed run, whose steps are planned from its epochs."""
    if not data.streaming:
        if train.max_steps:
            raise ConfigError(f"train.max_steps={train.max_steps} applies to data.streaming=true only: an indexed "
                              "run's steps are planned exactly from train.epochs (tools/estimate_steps.py prints them)")
        return
    if not train.max_steps:
        raise ConfigError("train.max_steps is required with data.streaming=true: a stream is read in order, not "
                          "indexed, so no step count can be planned from train.epochs; set train.max_steps=N "
                          "(optimizer steps)")
    problem = stream_packing_problem(data.packing)
    if problem:
        raise ConfigError(problem)
    if train.objective != "sft":
        raise ConfigError(f"train.objective={train.objective!r} reads preference pairs from indexed sources: "
                          "data.streaming=true trains train.objective=sft")


register_configs()
