"""The training loop every recipe shares: accelerate, AdamW, exact loss reductions and honest accounting."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device, set_seed
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from mvp_engine.kit.mllm.data import MLLMCollator, MLLMDataKit, TokenAccounting
from mvp_engine.kit.mllm.data.demo import write_demo_dataset

from .config import CONF_DIR, ConfigError, RunSpecs, resolve_run_specs
from .loss import token_weights, weighted_token_loss
from .recipe import Recipe


def step_groups(loader, size: int):
    """Micro-batches grouped per optimizer step; the last group may be short (it still steps)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


class Trainer:
    """Runs one recipe on one validated config; ``run()`` returns the end-of-run summary."""

    def __init__(self, cfg: DictConfig, recipe: Recipe):
        self.recipe = recipe
        self.specs: RunSpecs = resolve_run_specs(cfg, recipe.attention_backends)
        self.cfg = cfg
        train = self.specs.train
        self.accelerator = Accelerator(mixed_precision=train.mixed_precision)
        set_seed(train.seed)
        self.output_dir = Path(train.output_dir or "outputs/run")
        self.processor = recipe.build_processor(cfg.model)
        self.encoder = recipe.build_encoder(self.processor)
        self.model = recipe.build_model(cfg.model, self.specs.attention)
        data = self.specs.data
        if not data.sources:
            demo = self.specs.demo
            data.sources = [str(write_demo_dataset(demo.out_dir, demo.num_samples, demo.seed))]
        self.dataset = MLLMDataKit.build_dataset(data, self.encoder, rank=self.accelerator.process_index,
                                                 world_size=self.accelerator.num_processes,
                                                 drop_last=train.drop_last)
        self.collator = MLLMCollator(recipe.pad_token_id(self.processor), train.pad_to_multiple_of)
        self.packed = data.packing is not None
        self.prepare = recipe.prepare_packed if self.packed else recipe.prepare_padded
        self.total_steps = self.dataset.estimate_total_steps(train.epochs, train.micro_batch_size,
                                                             train.gradient_accumulation_steps)

    def _optimizer_and_schedule(self):
        train = self.specs.train
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.learning_rate,
                                      weight_decay=train.weight_decay)
        scheduler = get_scheduler(train.lr_scheduler, optimizer,
                                  num_warmup_steps=math.ceil(train.warmup_ratio * self.total_steps),
                                  num_training_steps=max(1, self.total_steps))
        return optimizer, scheduler

    def _loader(self, epoch: int) -> DataLoader:
        self.dataset.set_epoch(epoch)
        train = self.specs.train
        if hasattr(self.dataset, "worker_batch_size"):
            self.dataset.worker_batch_size = train.micro_batch_size
        return DataLoader(self.dataset, batch_size=train.micro_batch_size, collate_fn=self.collator,
                          drop_last=train.drop_last, num_workers=train.num_workers)

    def _train_step(self, group: list[dict], model, optimizer, scheduler) -> tuple[float, float]:
        """One optimizer step over ``group``; the denominator covers every micro-batch on every rank."""
        reduction = self.specs.train.loss_reduction
        local = sum(token_weights(b["labels"], b["pack_segment_ids"], reduction).sum() for b in group)
        total = self.accelerator.reduce(torch.as_tensor(local, device=self.accelerator.device, dtype=torch.float64),
                                        reduction="sum")
        denominator = total.clamp(min=1e-12)
        step_loss = 0.0
        for index, batch in enumerate(group):
            batch = send_to_device(batch, self.accelerator.device)
            sync = index == len(group) - 1
            context = self.accelerator.no_sync(model) if not sync else nullcontext()
            with context:
                outputs = model(**self.prepare(batch, model, self.specs.attention))
                part = weighted_token_loss(outputs.logits, batch["labels"], batch["pack_segment_ids"], reduction)
                loss = part.weighted_sum / denominator * self.accelerator.num_processes
                self.accelerator.backward(loss)
            step_loss += float(part.weighted_sum.detach()) / float(denominator)
        grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.specs.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = float(self.accelerator.reduce(torch.tensor(step_loss, device=self.accelerator.device),
                                                  reduction="sum"))
        return step_loss, float(grad_norm)

    def run(self) -> dict:
        train = self.specs.train
        optimizer, scheduler = self._optimizer_and_schedule()
        model, optimizer, scheduler = self.accelerator.prepare(self.model, optimizer, scheduler)
        model.train()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        main = self.accelerator.is_main_process
        totals = TokenAccounting()
        dropped = Counter()
        losses: list[float] = []
        steps = 0
        started = time.perf_counter()
        progress = tqdm(total=self.total_steps, disable=not main, desc=f"{self.recipe.name} train")
        with open(self.output_dir / "metrics.jsonl", "w") as metrics:
            for epoch in range(train.epochs):
                dropped.update(self.dataset.plan(epoch).drop_counts)
                for group in step_groups(self._loader(epoch), train.gradient_accumulation_steps):
                    step_start = time.perf_counter()
                    loss, grad_norm = self._train_step(group, model, optimizer, scheduler)
                    seconds = time.perf_counter() - step_start
                    local = sum((TokenAccounting.from_batch(b) for b in group), TokenAccounting())
                    step_counts = TokenAccounting.from_tensor(self.accelerator.reduce(
                        local.as_tensor().to(self.accelerator.device), reduction="sum").cpu())
                    totals = totals + step_counts
                    steps += 1
                    losses.append(loss)
                    record = {"step": steps, "epoch": epoch, "loss": loss, "lr": scheduler.get_last_lr()[0],
                              "grad_norm": grad_norm, "effective_tokens": step_counts.effective,
                              "supervised_tokens": step_counts.supervised, "samples": step_counts.samples,
                              "packs": step_counts.packs, "padding_ratio": step_counts.padding_ratio,
                              "tokens_per_s": step_counts.effective / seconds}
                    if main:
                        metrics.write(json.dumps(record) + "\n")
                        progress.update(1)
                        progress.set_postfix(loss=f"{loss:.3f}")
                        if steps % train.log_every == 0:
                            progress.write(
                                f"step {steps}/{self.total_steps} epoch {epoch} loss {loss:.4f} "
                                f"lr {record['lr']:.2e} tokens {step_counts.effective} "
                                f"supervised {step_counts.supervised} samples {step_counts.samples} "
                                f"padding {step_counts.padding_ratio:.1%} tok/s {record['tokens_per_s']:.0f}")
        progress.close()
        totals.dropped = dropped
        summary = self._summary(totals, losses, steps, time.perf_counter() - started)
        if main:
            self._save(model, summary)
        return summary

    def _summary(self, totals: TokenAccounting, losses: list[float], steps: int, seconds: float) -> dict:
        head = losses[: max(1, len(losses) // 10)]
        tail = losses[-max(1, len(losses) // 10):]
        return {
            "recipe": self.recipe.name,
            "packing": None if not self.packed else self.specs.data.packing.strategy,
            "attention": self.specs.attention,
            "estimated_steps": self.total_steps,
            "actual_steps": steps,
            "seconds": seconds,
            "effective_tokens_per_s": totals.effective / seconds if seconds else 0.0,
            "loss_first": head and sum(head) / len(head),
            "loss_last": tail and sum(tail) / len(tail),
            "losses": losses,
            "totals": totals.to_dict(),
            "output_dir": str(self.output_dir),
        }

    def _save(self, model, summary: dict) -> None:
        model_dir = self.output_dir / "model"
        self.accelerator.unwrap_model(model).save_pretrained(model_dir)
        self.processor.save_pretrained(model_dir)
        with open(self.output_dir / "summary.json", "w") as handle:
            json.dump(summary, handle, indent=2)
        print(f"summary: steps {summary['actual_steps']} (estimated {summary['estimated_steps']}), loss "
              f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}, effective tokens/s "
              f"{summary['effective_tokens_per_s']:.0f}, padding {summary['totals']['padding_ratio']:.1%}, "
              f"dropped {summary['totals']['dropped']}; saved to {model_dir}")


def run_recipe(cfg: DictConfig, recipe: Recipe) -> dict:
    """Hydra entry body of every recipe: a bad config stops the run with one line naming the key."""
    try:
        trainer = Trainer(cfg, recipe)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    return trainer.run()


def hydra_main(recipe: Recipe):
    """The ``main()`` of ``recipes/<name>/train.py``: Hydra over ``conf/<name>.yaml``, then :func:`run_recipe`."""

    @hydra.main(config_path=str(CONF_DIR), config_name=recipe.name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run_recipe(cfg, recipe)

    return main
