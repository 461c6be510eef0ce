"""Check a data set before a long run: every bad record, in one pass, with its fault class and where it is.

Why: a run skips bad records (``data.on_bad_record=skip``) but stops when more than ``data.max_bad_fraction`` of
them are bad, and a corrupt image body only shows when it is decoded, mid-epoch. This reads every source through
the recipe's own reader and encoder, exactly as training does (same overrides, same primary config; ``--config-name``
picks another recipe), measures every record (text and image headers), and with ``--decode`` also fully decodes
every image through the recipe's image processor, in parallel processes. It prints a table of fault classes with
counts and example origins, writes ``bad_records.jsonl`` (the same report a run writes) and exits 1 when anything
is bad.

    python tools/check_data.py data.sources=[/data/llava.jsonl] data.image_root=/data/images
    python tools/check_data.py --decode data.sources=[/data/mix.jsonl] --config-name llava
    python tools/check_data.py --decode +check.workers=8 +check.out_dir=/tmp/check

Settings live under ``check.*`` (``CheckSpec``): ``workers`` (decode processes; null: the CPU count) and
``out_dir`` (null: the Hydra run directory). ``check_records(cfg, decode, workers)`` returns the report for tests.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as ``python tools/check_data.py`` without an installed package
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from mvp_engine.engine.config import ConfigError, data_with_sources, resolve_run_specs  # noqa: E402
from mvp_engine.engine.testing import load_recipe  # noqa: E402
from mvp_engine.kit.mllm.data import BadRecord, BadRecordReport, MLLMDataKit, MLLMRecordError  # noqa: E402

DECODE_FLAG = "--decode"
EXAMPLES = 3


@dataclass
class CheckSpec:
    """The ``check.*`` keys."""

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


_ENCODER = None  # the recipe's encoder, inherited by forked decode workers


def _decode(record) -> dict | None:
    try:
        _ENCODER.encode(record)
    except MLLMRecordError as err:
        return BadRecord.from_error(err, "decode").to_dict()
    return None


def check_records(cfg: DictConfig, recipe: str, decode: bool = False, workers: int | None = None) -> BadRecordReport:
    """Read, measure and (``decode``) encode every record as a run would; every fault goes into the report."""
    global _ENCODER
    loaded = load_recipe(recipe)
    specs = resolve_run_specs(cfg, loaded.attention_backends)
    data = data_with_sources(specs)
    report = BadRecordReport("skip", max_fraction=1.0)
    records = MLLMDataKit.read_records(data, report)
    _ENCODER = loaded.build_encoder(loaded.build_processor(cfg.model))
    measured = []
    for record in tqdm(records, desc="measure", mininterval=2):
        try:
            _ENCODER.measure(record)
        except MLLMRecordError as err:
            report.add_error(err, "measure")
            continue
        measured.append(record)
    if decode and measured:
        # fork: the workers inherit the encoder instead of pickling it
        with multiprocessing.get_context("fork").Pool(workers or os.cpu_count()) as pool:
            for bad in tqdm(pool.imap(_decode, measured, chunksize=8), total=len(measured), desc="decode",
                            mininterval=2):
                if bad:
                    report.add(BadRecord(**bad))
    return report


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


def recipe_name(cfg: DictConfig) -> str:
    if HydraConfig.initialized() and HydraConfig.get().job.config_name:
        return str(HydraConfig.get().job.config_name)
    return str(cfg.model.name)


DECODE = DECODE_FLAG in sys.argv
if DECODE:  # a plain flag, not a Hydra override
    sys.argv.remove(DECODE_FLAG)


@hydra.main(config_path="../conf", config_name="qwen2_vl", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        spec = check_spec(cfg)
        report = check_records(cfg, recipe_name(cfg), decode=DECODE, workers=spec.workers)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    out_dir = resolve_out_dir(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write(out_dir / "bad_records.jsonl")
    print(format_table(report, DECODE))
    print(f"wrote {out_dir / 'bad_records.jsonl'}")
    if report.count:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
