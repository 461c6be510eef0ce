"""Packing and data specs: structured configs validated on construction, registered with Hydra."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hydra.core.config_store import ConfigStore

from .energon import SPLIT_PART, is_energon_folder
from .mixture import MLLMSource, source_entries
from .sources import DEFAULT_MAX_RECORD_BYTES

STRATEGIES = ("greedy", "bfd")
OVERLONG_POLICIES = ("drop", "error", "truncate")
BALANCE_MODES = ("none", "compute")


def _require(ok: bool, field_name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"packing.{field_name}={value!r} is invalid: allowed {allowed}")


@dataclass
class MLLMPackingSpec:
    """How samples are grouped into packs.

    ``strategy``: ``greedy`` (streaming first-fit over ``max_open_packs`` open packs fed from a seeded shuffle
    buffer of ``buffer_size`` samples) or ``bfd`` (best-fit-decreasing over each buffer of ``buffer_size``
    samples; a whole-dataset plan when the buffer covers the dataset). ``assembler_cls`` (a dotted path or a
    class) replaces the built-in algorithm. ``None`` caps mean unlimited. ``overlong``: what happens to a sample
    longer than ``max_seq_len``: ``drop`` (counted), ``error``, or ``truncate`` (text only; a sample whose media
    tokens run past the limit is dropped and counted instead).

    ``balance``: how the epoch's packs are assigned to ranks and optimizer steps: ``none`` (pack ``k`` goes to rank
    ``k mod world_size`` in planned order) or ``compute`` (packs of similar cost grouped into steps, the steps
    shuffled, each step's packs spread over ranks so the most loaded rank carries as little as possible), one
    window of ``balance_window`` steps at a time (``balance.py``). Needs the model's cost profile.
    """

    max_seq_len: int = 4096
    strategy: str = "greedy"
    max_open_packs: int = 64
    buffer_size: int = 1024
    max_media_per_pack: int | None = None
    max_samples_per_pack: int | None = None
    overlong: str = "drop"
    seed: int = 0
    assembler_cls: Any = None
    balance: str = "none"
    balance_window: int = 64

    def __post_init__(self) -> None:
        _require(isinstance(self.max_seq_len, int) and self.max_seq_len >= 1, "max_seq_len", "an int >= 1",
                 self.max_seq_len)
        _require(self.strategy in STRATEGIES or self.assembler_cls is not None, "strategy",
                 f"one of {list(STRATEGIES)} (or set assembler_cls)", self.strategy)
        _require(isinstance(self.max_open_packs, int) and self.max_open_packs >= 1, "max_open_packs",
                 "an int >= 1", self.max_open_packs)
        _require(isinstance(self.buffer_size, int) and self.buffer_size >= 1, "buffer_size", "an int >= 1",
                 self.buffer_size)
        for name in ("max_media_per_pack", "max_samples_per_pack"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value >= 1), name, "null or an int >= 1", value)
        _require(self.overlong in OVERLONG_POLICIES, "overlong", f"one of {list(OVERLONG_POLICIES)}", self.overlong)
        _require(isinstance(self.seed, int) and self.seed >= 0, "seed", "an int >= 0", self.seed)
        _require(self.assembler_cls is None or isinstance(self.assembler_cls, (str, type)), "assembler_cls",
                 "null, a dotted path or a class", self.assembler_cls)
        _require(self.balance in BALANCE_MODES, "balance", f"one of {list(BALANCE_MODES)}", self.balance)
        _require(isinstance(self.balance_window, int) and self.balance_window >= 1, "balance_window",
                 "an int >= 1 (optimizer steps per balancing window)", self.balance_window)


BAD_RECORD_POLICIES = ("skip", "error")


@dataclass
class MLLMDataSpec:
    """Where records come from and how they become batches.

    ``packing=None`` means no packing: one sample per item, padded by the collator; ``max_seq_len`` and
    ``overlong`` then bound single samples the same way packing would.
    """

    sources: list[Any] = field(default_factory=list)  # paths, or {path, repeat, name, image_root} (mixture.py)
    eval_sources: list[Any] = field(default_factory=list)  # held-out sources, each planned and packed on its own
    image_root: str | None = None
    packing: MLLMPackingSpec | None = None
    max_seq_len: int = 4096
    overlong: str = "drop"
    seed: int = 0
    shuffle: bool = True
    on_bad_record: str = "skip"  # skip: leave it out, counted and reported; error: the first one stops the run
    max_bad_fraction: float = 0.01  # under skip, more bad records than this fraction of those read stops the run
    allow_leading_assistant: bool = False  # a conversation opening with an assistant turn is a bad record unless set
    cache_dir: str | None = None  # converted sources and measured metadata; None: $VLM_PACKING_CACHE or ~/.cache/...
    measure_cache: bool = True  # reuse measured lengths while sources, media files and encoder are unchanged
    measure_workers: int = 0  # processes measuring records on a cold start; 0: one per CPU core
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # a larger JSON/JSONL record is a bad record, left unread
    # folders (real paths: symlinks resolved) every source's media may lie in besides its image root and its folder
    media_roots: list[str] = field(default_factory=list)
    # read the sources in order and pack from a seeded buffer, without an index or a measure pass (stream.py): for
    # data that cannot be indexed first; the run's length is then train.max_steps
    streaming: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            self.sources = [self.sources]
        self.source_entries()  # a bad entry fails here, as one line naming it
        if isinstance(self.eval_sources, str):
            self.eval_sources = [self.eval_sources]
        self.eval_source_entries()
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(f"data.on_bad_record={self.on_bad_record!r} is invalid: allowed one of "
                             f"{list(BAD_RECORD_POLICIES)}")
        if not isinstance(self.max_bad_fraction, (int, float)) or not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"data.max_bad_fraction={self.max_bad_fraction!r} is invalid: allowed a float in [0, 1]")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong={self.overlong!r} is invalid: allowed one of {list(OVERLONG_POLICIES)}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise ValueError(f"data.max_seq_len={self.max_seq_len!r} is invalid: allowed an int >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed={self.seed!r} is invalid: allowed an int >= 0")
        if not isinstance(self.measure_workers, int) or self.measure_workers < 0:
            raise ValueError(f"data.measure_workers={self.measure_workers!r} is invalid: allowed an int >= 0 "
                             "(0: one per CPU core)")
        if isinstance(self.max_record_bytes, bool) or not isinstance(self.max_record_bytes, int) or \
                self.max_record_bytes < 1:
            raise ValueError(f"data.max_record_bytes={self.max_record_bytes!r} is invalid: allowed an int >= 1 "
                             f"(bytes; default {DEFAULT_MAX_RECORD_BYTES})")
        if not isinstance(self.streaming, bool):
            raise ValueError(f"data.streaming={self.streaming!r} is invalid: allowed true or false")
        if isinstance(self.media_roots, str):
            self.media_roots = [self.media_roots]
        if not all(isinstance(root, str) and root for root in self.media_roots):
            raise ValueError(f"data.media_roots={self.media_roots!r} is invalid: allowed a list of folders")

    def source_entries(self) -> list[MLLMSource]:
        """``sources`` as validated :class:`MLLMSource` entries (path, repeat, name, image_root)."""
        return source_entries(self.sources)

    def effective_packing(self) -> MLLMPackingSpec:
        """The packing spec to plan with; unpacked data plans one sample per pack under the data limits."""
        if self.packing is not None:
            return self.packing
        return MLLMPackingSpec(max_seq_len=self.max_seq_len, overlong=self.overlong, seed=self.seed,
                               assembler_cls="mvp_engine.kit.mllm.data.assembler.SingleSampleAssembler")

    def eval_source_entries(self) -> list[MLLMSource]:
        """``eval_sources`` as validated entries (the kinds and keys of ``sources``); a ``repeat`` is refused: every
        held-out record is evaluated once. So is an Energon-prepared folder: it is read as its ``train`` split part
        (``energon.py``), which an evaluation would then measure as held out."""
        entries = source_entries(self.eval_sources, "data.eval_sources")
        for index, entry in enumerate(entries):
            if entry.repeat != 1:
                raise ValueError(f"data.eval_sources[{index}]: repeat={entry.repeat:g} does not apply to an eval "
                                 "source (each of its records is evaluated once)")
            if is_energon_folder(entry.path):
                raise ValueError(f"data.eval_sources[{index}]: {entry.path} is an Energon-prepared folder, read as its "
                                 f"{SPLIT_PART!r} split part: name its held-out shards by pattern instead "
                                 "(shard-{0000..0009}.tar)")
        return entries

    def eval_spec(self, source: MLLMSource) -> MLLMDataSpec:
        """One eval source as a data spec of its own, planned and packed like the training set (same packing and
        limits) but in record order and without balancing: an evaluation reads every record once, in a plan that
        does not depend on the training seed's shuffle. Indexed even in stream mode: an evaluation reads a known
        set to its end."""
        packing = None if self.packing is None else replace(self.packing, balance="none")
        entry = {"path": source.path, "name": source.name, "image_root": source.image_root}
        return replace(self, sources=[entry], eval_sources=[], shuffle=False, packing=packing, streaming=False)


def register_configs() -> None:
    """Make ``conf/packing/*.yaml`` validate against :class:`MLLMPackingSpec`."""
    cs = ConfigStore.instance()
    cs.store(group="packing", name="packing_schema", node=MLLMPackingSpec)


register_configs()
