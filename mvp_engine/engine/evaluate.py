"""The stand-alone evaluation every recipe's ``evaluate.py`` runs: ``python -m recipes.<name>.evaluate
model.pretrained=<dir> data.eval_sources=[...]`` (the recipe's Hydra config; ``+packing=...`` optional).

It is the trainer's evaluation (``evaluation.Evaluator``) without the training: the same specs, data sets, batches
and loss, so a run's last ``eval_loss`` and this entry's on the saved model agree. It writes ``eval.json`` in its run
directory (``train.output_dir``); on several processes every rank evaluates its packs and the sums are reduced
(``train.context_parallel_size`` splits each row over a CP group, as in training).

It evaluates a saved model only: ``model.pretrained`` is a ``save_pretrained`` folder or a LoRA adapter folder
(``<run>/model``, which holds or names its base, ``lora.py``); without it the loss would be a random model's, a
number that looks like a result. Nothing is fetched: the model hub is off while the model loads, so a name that is
no local folder fails at once instead of retrying downloads, and an adapter folder whose base is not here stops
with one line before that (``lora.check_adapter_base``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import huggingface_hub.constants
import hydra
from omegaconf import DictConfig

from mvp_engine.kit.mllm.data import MLLMRecordError, TooManyBadRecords

from .config import CONF_DIR, ConfigError, model_spec
from .evaluation import describe
from .launch import describe_processes, end_processes
from .lora import check_adapter_base
from .recipe import Recipe
from .run import assemble

EVAL_FILE = "eval.json"
JOB_NAME = "evaluate"  # Hydra's job name of this entry (conf/<name>.yaml names the training entry's, "train")


@contextmanager
def hub_offline() -> Iterator[None]:
    """Inside, transformers and peft treat the model hub as unreachable. ``HF_HUB_OFFLINE`` in the environment is read
    once, when huggingface_hub is imported: its constant, which they consult, is set instead, and restored after."""
    before = huggingface_hub.constants.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = before


def evaluate(cfg: DictConfig, recipe: Recipe) -> dict:
    """Evaluate the saved model ``model.pretrained`` on ``data.eval_sources``; returns what ``eval.json`` holds."""
    pretrained = model_spec(cfg.model).pretrained
    if not pretrained:
        raise ConfigError("model.pretrained is not set: name the saved model to evaluate (model.pretrained=<run "
                          "dir>/model); a randomly initialised model's eval loss means nothing")
    check_adapter_base(pretrained)
    with hub_offline():
        run = assemble(cfg, recipe, "eval")
    specs, accelerator, train = run.specs, run.accelerator, run.specs.train
    if accelerator.is_main_process:
        print(f"{describe_processes(accelerator)}; attention {specs.attention} "
              f"({'packed' if run.packed else 'unpacked'})")
    started = time.perf_counter()
    metrics, records = run.evaluator(run.model, desc=f"{recipe.name} eval")
    result = {**metrics, "records": records, "recipe": recipe.name, "pretrained": specs.model.pretrained,
              "packing": None if not run.packed else specs.data.packing.strategy, "attention": specs.attention,
              "world_size": accelerator.num_processes, "context_parallel_size": run.layout.cp_size,
              "micro_batch_size": train.micro_batch_size,
              "seconds": time.perf_counter() - started}
    output_dir = run.output_dir
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / EVAL_FILE).write_text(json.dumps(result, indent=2))
        print(f"{describe(result, digits=6)}; written to {output_dir / EVAL_FILE}")
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
    :func:`evaluate_recipe`. The recipes' configs name the Hydra job ``train`` (the training entry's); this entry
    puts ``hydra.job.name=evaluate`` first on the command line, so its ``.hydra`` record says what ran, and a
    ``hydra.job.name=`` given on the command line still wins."""

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        evaluate_recipe(cfg, recipe)

    def entry() -> None:
        sys.argv[1:1] = [f"hydra.job.name={JOB_NAME}"]
        main()

    return entry
