"""The stand-alone evaluation every recipe's ``evaluate.py`` runs: ``python -m recipes.<name>.evaluate
model.pretrained=<dir> data.eval_sources=[...]`` (the recipe's Hydra config; ``+packing=...`` optional).

It is the trainer's evaluation (``evaluation.Evaluator``) without the training: the same specs, data sets, batches
and loss, so a run's last ``eval_loss`` and this entry's on the saved model agree. It writes ``eval.json`` in its run
directory (``train.output_dir``); on several processes every rank evaluates its packs and the sums are reduced
(``train.context_parallel_size`` splits each row over a CP group, as in training).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMRecordError, TooManyBadRecords

from .config import CONF_DIR, ConfigError, resolve_run_specs
from .context_parallel import build_layout, make_sequence_parallel, row_multiple
from .evaluation import build_evaluator
from .launch import build_accelerator, describe_processes, end_processes
from .participation import media_kinds
from .recipe import Recipe
from .train_step import TrainStep

EVAL_FILE = "eval.json"


def evaluate(cfg: DictConfig, recipe: Recipe) -> dict:
    """Evaluate ``model`` (``model.pretrained``, else the config's random initialisation) on ``data.eval_sources``;
    returns what ``eval.json`` holds."""
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    if not specs.data.eval_sources:
        raise ConfigError("data.eval_sources is empty: name the records to evaluate on (data.eval_sources=[...])")
    if not cfg.model.get("pretrained"):
        print("model.pretrained is not set: evaluating the randomly initialised model", file=sys.stderr)
    train = specs.train
    accelerator = build_accelerator(train.mixed_precision)
    processor = recipe.build_processor(cfg.model)
    packed = specs.data.packing is not None
    layout = build_layout(accelerator, train.context_parallel_size, packed)
    model = make_sequence_parallel(recipe.build_model(cfg.model, specs.attention).to(accelerator.device), layout)
    collator = MLLMCollator(recipe.pad_token_id(processor), row_multiple(train.pad_to_multiple_of, layout.cp_size))
    step = TrainStep(accelerator, recipe.prepare_packed if packed else recipe.prepare_padded, specs.attention,
                     recipe.dummy_media(model), train, media_kinds(model), layout.shard)
    evaluator = build_evaluator(specs, accelerator, recipe.build_encoder(processor), collator, step, layout)
    if accelerator.is_main_process:
        print(f"{describe_processes(accelerator)}; attention {specs.attention} "
              f"({'packed' if packed else 'unpacked'})")
    started = time.perf_counter()
    metrics, records = evaluator(model, desc=f"{recipe.name} eval")
    result = {**metrics, "records": records, "recipe": recipe.name, "pretrained": cfg.model.get("pretrained"),
              "packing": None if not packed else specs.data.packing.strategy, "attention": specs.attention,
              "world_size": accelerator.num_processes, "context_parallel_size": layout.cp_size,
              "micro_batch_size": train.micro_batch_size,
              "seconds": time.perf_counter() - started}
    output_dir = Path(train.output_dir or "outputs/eval")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / EVAL_FILE).write_text(json.dumps(result, indent=2))
        print(f"eval_loss {result['eval_loss']:.6f} over {result['eval_tokens']} tokens of "
              f"{result['eval_samples']} samples; written to {output_dir / EVAL_FILE}")
    return result


def evaluate_recipe(cfg: DictConfig, recipe: Recipe) -> dict:
    """Hydra entry body of every recipe's ``evaluate.py``: a bad config or bad data stops with one line on stderr
    naming the key or the record, exit status 1; the process group is torn down on every way out."""
    try:
        try:
            return evaluate(cfg, recipe)
        except ConfigError as err:
            line = f"config error: {err}"
        except (MLLMRecordError, TooManyBadRecords) as err:
            line = f"data error: {err}"
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(1)
    finally:
        end_processes()


def hydra_evaluate(recipe: Recipe):
    """The ``main()`` of ``recipes/<name>/evaluate.py``: Hydra over ``conf/<name>.yaml``, then
    :func:`evaluate_recipe`."""

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        evaluate_recipe(cfg, recipe)

    return main
