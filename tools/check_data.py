"""Check a data set before a long run: every bad record, in one pass, with its fault class and where it is.

Why: a run skips bad records (``data.on_bad_record=skip``) but stops when more than ``data.max_bad_fraction`` of
them are bad, and a corrupt image body only shows when it is decoded, mid-epoch. This reads every source kind a run
reads (JSON, JSONL, parquet, ``save_to_disk`` folders) through the DataKit's own record store and measure pass,
with the recipe's encoder (same overrides, same primary config; ``--config-name`` picks another recipe), and with
``--decode`` also encodes every measured record, images and videos decoded, in parallel processes
(``find_bad_records`` of the DataKit does the work; this is its command line). It prints a table of fault classes
with counts and example origins (``file:line``, ``file#row``, ``folder#row``), writes ``bad_records.jsonl`` (the same
report a run writes) and exits 1 when anything is bad. Without ``data.sources`` it checks the demo set (``demo.*``).

    python tools/check_data.py data.sources=[/data/llava.jsonl] data.image_root=/data/images
    python tools/check_data.py --decode data.sources=[/data/mix.parquet,/data/saved_set] --config-name llava
    python tools/check_data.py --decode +check.workers=8 +check.out_dir=/tmp/check

Settings live under ``check.*`` (``CheckSpec``): ``decode`` (``--decode`` sets it), ``workers`` (measuring and
decoding processes; null: ``data.measure_workers`` and the CPU count) and ``out_dir`` (null: the Hydra run
directory). ``check_records(cfg, recipe, decode, workers)`` returns the report for tests.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mvp_engine.engine.config import ConfigError, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.recipe import load_recipe, recipe_name
from mvp_engine.engine.run_data import run_data_spec
from mvp_engine.kit.mllm.data import BadRecord, BadRecordReport, MLLMRecordError, find_bad_records

DECODE_FLAG = "--decode"  # a plain flag on the command line, read as ``check.decode=true``
EXAMPLES = 3


@dataclass
class CheckSpec:
    """The ``check.*`` keys."""

    decode: bool = False
    workers: int | None = None
    out_dir: str | None = None

    def __post_init__(self) -> None:
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise ConfigError(f"check.workers={self.workers!r} is invalid: allowed null or an int >= 1")


def check_spec(cfg: DictConfig) -> CheckSpec:
    node = cfg.get("check")
    given = {} if node is None else OmegaConf.to_container(node, resolve=True)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CheckSpec), given))
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf type and unknown-key errors
        raise ConfigError(f"check: {str(err).splitlines()[0]}") from None


def check_records(cfg: DictConfig, recipe: str, decode: bool = False, workers: int | None = None) -> BadRecordReport:
    """Read, measure and (``decode``) encode every record as a run would; every fault goes into the report."""
    loaded = load_recipe(recipe)
    data = run_data_spec(resolve_run_specs(cfg, loaded.attention_backends))
    encoder = loaded.build_encoder(loaded.build_processor(cfg.model))
    return find_bad_records(data, encoder, decode=decode, workers=workers)


def format_table(report: BadRecordReport, decoded: bool) -> str:
    by_reason: dict[tuple[str, str], list[BadRecord]] = defaultdict(list)
    for bad in report.records.values():
        by_reason[bad.stage, bad.reason].append(bad)
    lines = [f"check_data: {report.records_read} records read, {report.count} bad ({report.fraction():.1%})"
             + ("" if decoded else "; image bodies not decoded (add --decode)"),
             f"{'stage':8} {'reason':20} {'count':>7}  examples"]
    for (stage, reason), bads in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        examples = ", ".join(b.origin for b in bads[:EXAMPLES])
        lines.append(f"{stage:8} {reason:20} {len(bads):>7}  {examples}")
    return "\n".join(lines)


def resolve_out_dir(spec: CheckSpec) -> Path:
    if spec.out_dir:
        return Path(spec.out_dir)
    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / "check_data"


@hydra.main(config_path="../conf", config_name="qwen2_vl", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        cfg = with_demo_data(cfg)  # no data.sources: the demo set, written here by the entry point
        spec = check_spec(cfg)
        report = check_records(cfg, recipe_name(cfg), decode=spec.decode, workers=spec.workers)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    except MLLMRecordError as err:  # a source that cannot be opened (a bad record is reported, never raised)
        raise SystemExit(f"data error: {err}") from None
    out_dir = resolve_out_dir(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write(out_dir / "bad_records.jsonl")
    print(format_table(report, spec.decode))
    print(f"wrote {out_dir / 'bad_records.jsonl'}")
    if report.count:
        raise SystemExit(1)


def hydra_args(argv: list[str]) -> list[str]:
    """The command line with ``--decode`` as the Hydra override it stands for, last (so a ``+check.decode=...``
    given too is not added twice)."""
    rest = [arg for arg in argv if arg != DECODE_FLAG]
    return rest + ["++check.decode=true"] if DECODE_FLAG in argv else rest


if __name__ == "__main__":
    sys.argv = hydra_args(sys.argv)  # Hydra reads sys.argv itself; done here, not on import
    main()
