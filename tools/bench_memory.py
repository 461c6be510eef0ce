"""Memory of a training step, counted from tensors: what FSDP2 shards off each rank, what recomputation saves.

Why: a model trains on a device only if its parameters, gradients and optimizer state plus the activations of one
micro-batch fit. Under DDP every rank holds all of the first three (16 bytes per parameter with fp32 AdamW);
FSDP2 (``train.sharding=fsdp2``) keeps 1/N of them per rank; activation checkpointing
(``train.activation_checkpointing=true``) keeps only each layer's inputs and recomputes the rest in backward, at the
price of one more forward. This measures both on a mid-size configuration of the LLaVA recipe: its ``build_model``
with the tiny config widened by overrides (defaults: ~100 M parameters), fp32 on CPU.

What is measured, exactly (from tensors, never from RSS):

- State per rank, 2 ranks over gloo (``torch.multiprocessing``, a file rendezvous): each rank builds the same seeded
  model, freezes what the recipe declares unreachable (as the trainer does), wraps it in torch's DDP or shards it
  with the engine's ``mvp_engine.engine.sharding.shard_model`` (FSDP2), builds the engine's AdamW
  (``optimizer_and_schedule``), trains one packed micro-batch of ``--state-length`` tokens (the rank's pack of the
  run's plan; the zero-weighted dummy media pass where it has no image) and steps. Then, before any ``zero_grad``
  (the peak of the step), it adds up the bytes of every parameter, every gradient and every optimizer state tensor
  (``exp_avg``, ``exp_avg_sq``, ``step``); a ``DTensor`` counts its local shard. Not counted: DDP's gradient
  buckets (another copy of the gradients for its all-reduce), FSDP2's transient unsharded parameters of the layer
  it is computing.
- Activations, one process: the fullest pack of a ``+packing=greedy`` plan at ``--length`` (default 4096) tokens
  of the demo set, padded to exactly that many slots, through the recipe's ``prepare_packed`` on the packed default
  backend (``attention=auto``). Bytes saved for backward: ``mvp_engine.engine.recompute.SavedForBackward`` over
  the forward and the token loss (tensors autograd saves, plus the inputs each checkpointed layer keeps; each
  storage once; parameters left out), without and with activation checkpointing, on the same weights.
- The step time cost of recomputation, in the same run: prepare + forward + loss + backward, each mode first runs
  one untimed step (the one that counts its saved bytes, paying one-off costs), then ``--repeats`` timed steps,
  the modes interleaved; the fastest of each counts. The gradients of the two modes are compared too.

Targets, each printed with its measured value and OK/MISS:

1. FSDP2 per-rank state <= 0.55x DDP's at 2 ranks (the worst rank);
2. activation checkpointing's bytes saved for backward <= 0.3x the bytes without.

    python tools/bench_memory.py [--length 4096] [--state-length 512] [--samples 64] [--hidden 768]
        [--intermediate 2560] [--layers 12] [--heads 12] [--kv-heads 4] [--vision-hidden 384]
        [--vision-intermediate 1536] [--vision-layers 4] [--vision-heads 6] [--repeats 2] [--threads 1]
        [--workdir DIR] [--json PATH]

``--experts``: a MoE model's expert state per rank with ``train.expert_parallel_size=2`` vs without (the tiny
``qwen3_5_moe`` with ``--num-experts`` experts of ``--moe-intermediate`` per layer, DDP over 2 gloo ranks, one AdamW
step): the experts' weights, gradients and optimizer state counted from tensors; target: EP 2 <= 0.55x none's on
the worst rank (the routed experts' 3-D weights only: the routers and the shared expert stay whole on every rank).

``--loss``: the loss alone from hidden states (``--loss-hidden``), full vs chunked (``train.loss_impl``) at each
``--vocabs`` x ``--lengths``, every position supervised, fp32: peak added memory (the profiler's allocation events
in time order) and seconds; full only where its computed 12 bytes per logit fit ``--budget-gib``. Targets: chunked
peak <= 1 GiB at the longest length x largest vocabulary; chunked time <= 1.10x full's where full ran.

``--step``: one whole training step (prepare + forward + loss + backward, gradients included) of the widened model,
``--step-layers`` deep with its vocabulary widened to ``--step-vocab`` (``resize_token_embeddings``) and activation
checkpointing on, on the fullest pack of ``--step-length`` tokens, with each loss on the same weights (chunked
first); target: full's peak >= 3x chunked's. Under 10 minutes here at its defaults (16k tokens, 2 layers).

``main(argv)`` returns what it printed as a dict; the numbers come from functions returning data
(``measure_state``, ``measure_activations``, ``targets``), ``report`` only formats them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from mvp_engine.engine.config import RunSpecs, TrainSpec, compose_config, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.expert_parallel import exclude_from_ddp, expert_modules, split_experts
from mvp_engine.engine.linear_loss import HeadInputs, chunked_token_loss
from mvp_engine.engine.loss import weighted_token_loss
from mvp_engine.engine.participation import dummy_passes, forward_with_media_pass, freeze_parameters, media_kinds
from mvp_engine.engine.peak_memory import peak_added_bytes
from mvp_engine.engine.recipe import Recipe, load_recipe
from mvp_engine.engine.recompute import SavedForBackward, enable_activation_checkpointing
from mvp_engine.engine.run_data import build_run_dataset
from mvp_engine.engine.sharding import shard_model
from mvp_engine.engine.train_step import optimizer_and_schedule
from mvp_engine.kit.mllm.data import MLLMCollator

RECIPE = "llava"
EXPERTS_RECIPE = "qwen3_5_moe"  # --experts
EXPERT_MODES = ("none", "ep2")
WORLD_SIZE = 2
STATE_MODES = ("ddp", "fsdp2")
ACTIVATION_MODES = ("none", "checkpointing")
TARGET_STATE_RATIO = 0.55
TARGET_SAVED_RATIO = 0.3
EXACT_TOL = 1e-6
MIB = 2**20
GIB = 2**30
# --loss: the vocabularies (Qwen-VL, Gemma) and packed lengths of the table, and its targets
LOSS_VOCABS = (151936, 262144)
LOSS_LENGTHS = (4096, 8192, 16384, 32768)
LOSS_IMPLS = ("full", "chunked")
TARGET_CHUNKED_PEAK_GIB = 1.0  # at the longest length and the largest vocabulary
# full's computed bytes must fit this to run: 24 GiB (this machine's whole memory, shared) let full at 8k x 262k
# (exactly 24 GiB computed) start, and the kernel killed the bench
LOSS_BUDGET_GIB = 16.0
TARGET_CHUNKED_TIME_RATIO = 1.10  # chunked step time over full's, where full fits
FULL_BYTES_PER_LOGIT = 12  # fp32 logits, the log-softmax cross-entropy keeps, the logits' gradient
# --step: a whole training step of the widened model at a packed length, full vs chunked loss, and its target
STEP_LENGTH = 16384
# LLaVA-1.5's vocabulary (Llama 2's 32,000 and its added tokens): the recipe's test tokenizer has 3,000, which would
# make the loss a sliver of any step
STEP_VOCAB = 32064
STEP_LAYERS = 2  # the widened model's depth in --step: 16k tokens through 12 layers twice is ~20 min on one thread
STEP_SAMPLES = 400  # demo records planned: the fullest 16k pack of their plan is full
TARGET_STEP_PEAK_RATIO = 3.0  # full's peak over chunked's
STEP_ORDER = ("chunked", "full")  # chunked first: a first step's one-off allocations count against it


# ------------------------------------------------------------------------------------------ counting, exactly


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for ``tensor``: its local shard when it is a ``DTensor``."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer's state tensors on this rank, and their total."""
    parameters = list(model.parameters())
    out = {"parameters": sum(local_bytes(p) for p in parameters),
           "gradients": sum(local_bytes(p.grad) for p in parameters if p.grad is not None),
           "optimizer": sum(local_bytes(value) for state in optimizer.state.values() for value in state.values()
                            if isinstance(value, torch.Tensor))}
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------ model and data


def model_overrides(args: argparse.Namespace, positions: int, layers: int) -> list[str]:
    """Hydra overrides widening the recipe's tiny model to the bench's sizes (fp32, seeded), ``layers`` deep, for
    rows of ``positions`` tokens."""
    text, vision = "model.config.text_config", "model.config.vision_config"
    return [f"{text}.hidden_size={args.hidden}", f"{text}.intermediate_size={args.intermediate}",
            f"{text}.num_hidden_layers={layers}", f"{text}.num_attention_heads={args.heads}",
            f"{text}.num_key_value_heads={args.kv_heads}", f"{text}.max_position_embeddings={positions}",
            f"{vision}.hidden_size={args.vision_hidden}", f"{vision}.intermediate_size={args.vision_intermediate}",
            f"{vision}.num_hidden_layers={args.vision_layers}", f"{vision}.num_attention_heads={args.vision_heads}",
            "model.dtype=float32", f"model.seed={args.seed}"]


def run_specs(args: argparse.Namespace, recipe: Recipe, workdir: Path, length: int, positions: int | None = None,
              layers: int | None = None, samples: int | None = None) -> tuple[dict, RunSpecs]:
    """The model config (a plain dict: it travels to the ranks) and the specs of a greedy-packed run at
    ``length``, its sources filled with the demo set (``samples`` records; default ``--samples``); the model for
    rows of ``positions`` tokens (default ``--length``), ``layers`` deep (default ``--layers``)."""
    overrides = model_overrides(args, positions or args.length, layers or args.layers)
    cfg = with_demo_data(compose_config(RECIPE, [*overrides, "+packing=greedy", f"data.max_seq_len={length}",
                                                 f"demo.num_samples={samples or args.samples}",
                                                 f"demo.out_dir={workdir / 'demo'}", f"data.seed={args.seed}"]))
    return OmegaConf.to_container(cfg.model, resolve=True), resolve_run_specs(cfg, recipe.attention_backends)


def fullest_batches(recipe: Recipe, model_cfg: dict, specs: RunSpecs, count: int) -> list[dict]:
    """The ``count`` fullest packs of the run's first epoch, each collated as training collates it into one row
    padded to exactly ``max_seq_len`` slots."""
    processor = recipe.build_processor(model_cfg)
    dataset = build_run_dataset(specs, recipe.build_encoder(processor), None)
    plan = dataset.plan(0)
    packs = sorted(plan.packs, key=lambda pack: -sum(plan.lengths[i] for i in pack))[:count]
    if len(packs) < count:
        raise SystemExit(f"the plan has {len(packs)} packs, {count} needed: raise --samples")
    collator = MLLMCollator(recipe.pad_token_id(processor), specs.data.packing.max_seq_len)
    batches = [collator([dataset.encode_pack(pack)]) for pack in packs]
    for batch in batches:
        batch.pop("bad_records", None)  # batch-only, as the trainer's step boundary takes them
    return batches


def build_model(recipe: Recipe, model_cfg: dict, attention: str, checkpointing: bool = False):
    """The recipe's seeded model, its unreachable parameters frozen as the trainer freezes them, in train mode."""
    model = recipe.build_model(model_cfg, attention)
    freeze_parameters(model, [], recipe.unreachable_parameters(model))
    if checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def packed_loss(recipe: Recipe, model, batch: dict, attention: str, impl: str = "full") -> torch.Tensor:
    """prepare_packed + forward + token-mean loss, with the trainer's zero-weighted dummy media pass on a batch
    without media (``forward_with_media_pass``); ``impl`` as ``train.loss_impl``: ``full`` from the model's logits,
    ``chunked`` from the hidden states its head is handed (``HeadInputs``, as the trainer's step)."""
    kwargs, passes = recipe.prepare_packed(batch, model, attention), dummy_passes(batch, media_kinds(model))
    labels, segments = batch["labels"], batch["pack_segment_ids"]
    if impl == "full":
        outputs, dummy = forward_with_media_pass(model, kwargs, recipe.dummy_media(model), passes)
        part = weighted_token_loss(outputs.logits, labels, segments, "token")
    else:
        with HeadInputs(model) as head:
            outputs, dummy = forward_with_media_pass(model, kwargs, recipe.dummy_media(model), passes)
        part = head.loss(outputs.logits, labels, segments, "token")
    loss = part.weighted_sum / part.weight_total
    return loss if dummy is None else loss + dummy


# ------------------------------------------------------------------------------- state, on two ranks


def state_after_step(mode: str, recipe: Recipe, model_cfg: dict, attention: str, batch: dict,
                     train: TrainSpec) -> dict[str, int]:
    """One AdamW step of ``mode`` (torch's DDP or the engine's FSDP2) on this rank; the state bytes at its end."""
    model = build_model(recipe, model_cfg, attention)
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:  # over every rank, as a run's layout hands FSDP2 its world mesh
        wrapped = shard_model(model, train.mixed_precision, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer, _ = optimizer_and_schedule(wrapped, train, 1)
    packed_loss(recipe, wrapped, batch, attention).backward()
    optimizer.step()
    return state_bytes(wrapped, optimizer)


def rank_main(rank: int, rendezvous: str, model_cfg: dict, attention: str, batches: list[dict], train: TrainSpec,
              threads: int, out_dir: str) -> None:
    """One rank of ``measure_state`` (started by ``torch.multiprocessing.spawn``): every mode, then its numbers."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE)
    try:
        recipe = load_recipe(RECIPE)
        result = {mode: state_after_step(mode, recipe, model_cfg, attention, batches[rank], train)
                  for mode in STATE_MODES}
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def measure_state(model_cfg: dict, attention: str, batches: list[dict], train: TrainSpec, threads: int,
                  workdir: Path) -> dict[str, list[dict[str, int]]]:
    """Per mode, per rank: the state bytes after one step on 2 ranks."""
    out_dir = Path(tempfile.mkdtemp(dir=workdir, prefix="state"))
    torch.multiprocessing.spawn(rank_main, nprocs=WORLD_SIZE, join=True,
                                args=(str(out_dir / "rendezvous"), model_cfg, attention, batches, train, threads,
                                      str(out_dir)))
    ranks = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    return {mode: [rank[mode] for rank in ranks] for mode in STATE_MODES}


# ------------------------------------------------------------------------------ activations, one process


def timed_step(recipe: Recipe, model, batch: dict, attention: str, impl: str = "full") -> tuple[float, float]:
    """prepare + forward + loss (``impl``: :func:`packed_loss`) + backward from fresh gradients: its loss and
    seconds."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = packed_loss(recipe, model, batch, attention, impl)
    loss.backward()
    return float(loss.detach()), time.perf_counter() - start


def saved_bytes_step(recipe: Recipe, model, batch: dict, attention: str) -> int:
    """The untimed first step: bytes its forward leaves for backward, then its backward."""
    with SavedForBackward(model) as saved:
        loss = packed_loss(recipe, model, batch, attention)
        counted = saved.bytes
    loss.backward()
    return counted


def measure_activations(recipe: Recipe, model_cfg: dict, attention: str, batch: dict, repeats: int) -> dict:
    """Per mode (without / with activation checkpointing, the same weights): saved bytes, loss and the fastest step;
    the step ratio and how far the two modes' losses and gradients differ."""
    models = {mode: build_model(recipe, model_cfg, attention, checkpointing=mode == "checkpointing")
              for mode in ACTIVATION_MODES}
    out = {mode: {"saved_bytes": saved_bytes_step(recipe, model, batch, attention), "times_s": []}
           for mode, model in models.items()}
    for _ in range(repeats):
        for mode, model in models.items():
            out[mode]["loss"], seconds = timed_step(recipe, model, batch, attention)
            out[mode]["times_s"].append(seconds)
    for mode in ACTIVATION_MODES:
        out[mode]["step_s"] = min(out[mode]["times_s"])
    plain, recomputed = (dict(models[mode].named_parameters()) for mode in ACTIVATION_MODES)
    out["grad_diff"] = max(float((p.grad - recomputed[name].grad).abs().max())
                           for name, p in plain.items() if p.grad is not None)
    out["loss_diff"] = abs(out["none"]["loss"] - out["checkpointing"]["loss"])
    out["step_ratio"] = out["checkpointing"]["step_s"] / out["none"]["step_s"]
    out["saved_ratio"] = out["checkpointing"]["saved_bytes"] / out["none"]["saved_bytes"]
    out["parameters"] = sum(p.numel() for p in plain.values())
    out["trainable"] = sum(p.numel() for p in plain.values() if p.requires_grad)
    return out


# ------------------------------------------------------------------------------------------ the loss alone


def loss_step(impl: str, hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk_tokens: int):
    """The loss's forward and backward from the final hidden states (``impl`` full: the head's logits of every
    position then ``weighted_token_loss``; chunked: ``chunked_token_loss``), token reduction."""
    hidden.grad, head.weight.grad = None, None
    segments = torch.zeros_like(labels)
    if impl == "full":
        part = weighted_token_loss(head(hidden), labels, segments, "token")
    else:
        part = chunked_token_loss(hidden, head, labels, segments, "token", chunk_tokens=chunk_tokens)
    (part.weighted_sum / part.weight_total).backward()
    return float(part.weighted_sum.detach() / part.weight_total)


def measure_loss(length: int, vocab: int, hidden_size: int, chunk_tokens: int, budget_gib: float, seed: int) -> dict:
    """Peak added bytes and seconds of one loss forward + backward per impl at ``length`` x ``vocab`` (fp32; every
    position supervised, the worst case); full is only computed (``FULL_BYTES_PER_LOGIT`` per logit) where that is
    above ``budget_gib``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, hidden_size, generator=generator).requires_grad_()
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=hidden_size ** -0.5, generator=generator)
    labels = torch.randint(0, vocab, (1, length), generator=generator)
    out = {"length": length, "vocab": vocab, "full_computed_bytes": FULL_BYTES_PER_LOGIT * length * vocab}
    for impl in LOSS_IMPLS:
        if impl == "full" and out["full_computed_bytes"] > budget_gib * GIB:
            out[impl] = None
            continue
        start = time.perf_counter()
        peak = peak_added_bytes(lambda impl=impl: loss_step(impl, hidden, head, labels, chunk_tokens))
        out[impl] = {"peak_bytes": peak, "seconds": time.perf_counter() - start}
    return out


def loss_targets(rows: list[dict]) -> list[dict]:
    """Chunked peak at the longest length x largest vocabulary, and chunked time over full's where full ran."""
    last = max(rows, key=lambda row: (row["length"], row["vocab"]))
    peak = last["chunked"]["peak_bytes"] / GIB
    ratios = [row["chunked"]["seconds"] / row["full"]["seconds"] for row in rows if row["full"] is not None]
    ratio = max(ratios) if ratios else float("nan")
    return [{"name": "chunked_peak", "value": peak, "ok": peak <= TARGET_CHUNKED_PEAK_GIB,
             "line": f"(1) chunked loss peak <= {TARGET_CHUNKED_PEAK_GIB:g} GiB at {last['length']} x "
                     f"{last['vocab']}: {peak:.3f} GiB -> {verdict(peak <= TARGET_CHUNKED_PEAK_GIB)}"},
            {"name": "chunked_time", "value": ratio, "ok": bool(ratios) and ratio <= TARGET_CHUNKED_TIME_RATIO,
             "line": f"(2) chunked step time <= {TARGET_CHUNKED_TIME_RATIO}x full's where full fits: worst "
                     f"{ratio:.2f}x over {len(ratios)} sizes -> "
                     f"{verdict(bool(ratios) and ratio <= TARGET_CHUNKED_TIME_RATIO)}"}]


def run_loss(args: argparse.Namespace) -> dict:
    """The --loss table: every vocabulary x length, full vs chunked, and its targets."""
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in args.vocabs:
        for length in args.lengths:
            progress(f"loss at L={length}, V={vocab}")
            rows.append(measure_loss(length, vocab, args.loss_hidden, args.chunk_tokens, args.budget_gib, args.seed))
            progress(f"  {json.dumps(rows[-1])}")
    lines = [f"loss forward + backward from hidden states (hidden {args.loss_hidden}, fp32 on CPU, every position "
             f"supervised, chunks of {args.chunk_tokens}, torch threads {args.threads}); peak added memory from the "
             f"profiler's allocation events; full runs where {FULL_BYTES_PER_LOGIT} bytes per logit fit "
             f"{args.budget_gib:g} GiB",
             f"  {'vocab':>7s} {'L':>6s} {'full peak GiB':>14s} {'full s':>7s} {'chunked peak GiB':>17s} "
             f"{'chunked s':>10s}"]
    for row in rows:
        full = row["full"]
        left = (f"{full['peak_bytes'] / GIB:>14.3f} {full['seconds']:>7.2f}" if full is not None else
                f"{row['full_computed_bytes'] / GIB:>9.1f} (computed, does not fit)")
        lines.append(f"  {row['vocab']:>7d} {row['length']:>6d} {left} {row['chunked']['peak_bytes'] / GIB:>17.3f} "
                     f"{row['chunked']['seconds']:>10.2f}")
    found = loss_targets(rows)
    lines += ["targets:", *(f"  {t['line']}" for t in found), f"bench time {time.perf_counter() - started:.1f} s"]
    return {"rows": rows, "targets": found, "ok": all(t["ok"] for t in found), "args": vars(args), "lines": lines}


# ------------------------------------------------------------------------------ a whole step, full vs chunked


def measure_step(recipe: Recipe, model, batch: dict, attention: str) -> dict:
    """Per loss impl, on the same model: the peak added bytes (gradients included) and seconds of one step
    (prepare + forward + loss + backward from no gradients), and its loss."""
    out, measured = {}, {}
    for impl in STEP_ORDER:
        model.zero_grad(set_to_none=True)  # before the profiler: what it counts starts from no gradients
        peak = peak_added_bytes(lambda impl=impl: measured.update({impl: timed_step(recipe, model, batch, attention,
                                                                                     impl)}))
        out[impl] = {"peak_bytes": peak, "loss": measured[impl][0], "seconds": measured[impl][1]}
        progress(f"  {impl}: {json.dumps(out[impl])}")
    out["ratio"] = out["full"]["peak_bytes"] / out["chunked"]["peak_bytes"]
    out["loss_rel_diff"] = abs(out["chunked"]["loss"] - out["full"]["loss"]) / abs(out["full"]["loss"])
    return out


def run_step(args: argparse.Namespace, workdir: Path) -> dict:
    """The --step table: the widened model (``--step-layers`` deep, its vocabulary widened to ``--step-vocab``,
    activation checkpointing on, as a long packed row is trained) through one step of the fullest pack at
    ``--step-length`` tokens, with each loss; and its target."""
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(RECIPE)
    model_cfg, specs = run_specs(args, recipe, workdir, args.step_length, args.step_length, args.step_layers,
                                 args.step_samples)
    batch = fullest_batches(recipe, model_cfg, specs, 1)[0]
    model = build_model(recipe, model_cfg, specs.attention, checkpointing=True)
    torch.manual_seed(args.seed)
    model.resize_token_embeddings(args.step_vocab, mean_resizing=False)  # the head and the embedding, seeded
    parameters = sum(p.numel() for p in model.parameters())
    progress(f"step at L={args.step_length}, V={args.step_vocab}: {', '.join(STEP_ORDER)}")
    step = measure_step(recipe, model, batch, specs.attention)
    ok = step["ratio"] >= TARGET_STEP_PEAK_RATIO
    text = model_cfg["config"]["text_config"]
    lines = [f"recipe {RECIPE} widened: text hidden {text['hidden_size']}, intermediate {text['intermediate_size']}, "
             f"layers {text['num_hidden_layers']}, vocabulary {args.step_vocab}; {parameters / 1e6:.1f} M parameters, "
             f"fp32 on CPU, attention {specs.attention}, activation checkpointing, torch threads {args.threads}",
             f"one training step (prepare + forward + loss + backward, gradients included) of one packed row at "
             f"L={args.step_length} ({batch_line(batch)}); peak added memory from the profiler's allocation events",
             f"  {'loss':<8s} {'peak GiB':>9s} {'step s':>7s} {'loss':>10s}"]
    for impl in STEP_ORDER:
        lines.append(f"  {impl:<8s} {step[impl]['peak_bytes'] / GIB:>9.3f} {step[impl]['seconds']:>7.1f} "
                     f"{step[impl]['loss']:>10.6f}")
    line = (f"a whole step at {args.step_length} packed tokens: full's peak >= {TARGET_STEP_PEAK_RATIO:g}x "
            f"chunked's: {step['ratio']:.2f}x -> {verdict(ok)}")
    lines += ["targets:", f"  {line}", f"same loss: relative difference {step['loss_rel_diff']:.1e}",
              f"bench time {time.perf_counter() - started:.1f} s"]
    return {"recipe": RECIPE, "model": model_cfg["config"], "step": step, "ok": ok, "args": vars(args),
            "targets": [{"name": "step_peak", "value": step["ratio"], "limit": TARGET_STEP_PEAK_RATIO, "ok": ok,
                         "line": line}], "lines": lines}


# ------------------------------------------------------------------------- experts: EP 2 vs none, two ranks


def expert_overrides(args: argparse.Namespace) -> list[str]:
    """The MoE recipe's tiny model with ``--num-experts`` experts of ``--moe-intermediate`` per layer (fp32)."""
    text = "model.config.text_config"
    return [f"{text}.num_experts={args.num_experts}", f"{text}.moe_intermediate_size={args.moe_intermediate}",
            "model.dtype=float32", f"model.seed={args.seed}"]


def expert_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the experts' weights, their gradients and their optimizer state (``experts``), and of
    every parameter's (``total``)."""
    def held(parameters) -> int:
        return sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
                   + sum(local_bytes(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
                   for p in parameters)
    experts = [p for _, module in expert_modules(model) for p in module.parameters(recurse=False)]
    return {"experts": held(experts), "total": held(model.parameters())}


def experts_after_step(mode: str, recipe: Recipe, model_cfg: dict, attention: str, batch: dict,
                       train: TrainSpec) -> dict[str, int]:
    """One AdamW step under DDP, the experts whole (``none``) or split over the 2 ranks (``ep2``: the engine's
    ``split_experts`` and ``exclude_from_ddp``, as ``train.expert_parallel_size=2`` does); the state at its end."""
    model = build_model(recipe, model_cfg, attention)
    if mode == "ep2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
        exclude_from_ddp(model, split_experts(model, mesh, dist.get_world_size()))
    wrapped = DistributedDataParallel(model)
    optimizer, _ = optimizer_and_schedule(wrapped, train, 1)
    packed_loss(recipe, wrapped, batch, attention).backward()
    optimizer.step()
    return expert_state(wrapped, optimizer)


def experts_rank_main(rank: int, rendezvous: str, model_cfg: dict, attention: str, batches: list[dict],
                      train: TrainSpec, threads: int, out_dir: str) -> None:
    """One rank of ``run_experts`` (``torch.multiprocessing.spawn``): both modes, then its numbers."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE)
    try:
        recipe = load_recipe(EXPERTS_RECIPE)
        result = {mode: experts_after_step(mode, recipe, model_cfg, attention, batches[rank], train)
                  for mode in EXPERT_MODES}
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def run_experts(args: argparse.Namespace, workdir: Path) -> dict:
    """The --experts table: per rank, the experts' state after one step with EP 2 and without, and its target."""
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(EXPERTS_RECIPE)
    cfg = with_demo_data(compose_config(EXPERTS_RECIPE, [
        *expert_overrides(args), "+packing=greedy", f"data.max_seq_len={args.state_length}",
        f"demo.num_samples={args.samples}", f"demo.out_dir={workdir / 'demo'}", f"data.seed={args.seed}"]))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    batches = fullest_batches(recipe, model_cfg, specs, WORLD_SIZE)
    out_dir = Path(tempfile.mkdtemp(dir=workdir, prefix="experts"))
    progress(f"experts: {WORLD_SIZE} ranks, {', '.join(EXPERT_MODES)}")
    torch.multiprocessing.spawn(experts_rank_main, nprocs=WORLD_SIZE, join=True,
                                args=(str(out_dir / "rendezvous"), model_cfg, specs.attention, batches, specs.train,
                                      args.threads, str(out_dir)))
    ranks = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    ratio = max(rank["ep2"]["experts"] / rank["none"]["experts"] for rank in ranks)
    ok = ratio <= TARGET_STATE_RATIO
    text = model_cfg["config"]["text_config"]
    lines = [f"recipe {EXPERTS_RECIPE}: {text['num_experts']} experts (top-{text['num_experts_per_tok']}, "
             f"intermediate {text['moe_intermediate_size']}) in each of {text['num_hidden_layers']} layers, hidden "
             f"{text['hidden_size']}, fp32 on CPU, DDP over {WORLD_SIZE} gloo ranks, one packed micro-batch each "
             f"(L={args.state_length}); per rank after one AdamW step: weights + gradients + optimizer state, from "
             "tensors",
             f"  {'mode':<5s} {'rank':>4s} {'experts MiB':>12s} {'all MiB':>9s}"]
    for mode in EXPERT_MODES:
        for rank, numbers in enumerate(ranks):
            lines.append(f"  {mode:<5s} {rank:>4d} {numbers[mode]['experts'] / MIB:>12.2f} "
                         f"{numbers[mode]['total'] / MIB:>9.2f}")
    line = (f"EP 2 per-rank expert state <= {TARGET_STATE_RATIO}x none's (the worst rank): {ratio:.3f}x -> "
            f"{verdict(ok)}")
    lines += ["targets:", f"  {line}", f"bench time {time.perf_counter() - started:.1f} s"]
    return {"recipe": EXPERTS_RECIPE, "ranks": ranks, "ratio": ratio, "ok": ok, "args": vars(args),
            "targets": [{"name": "experts", "value": ratio, "limit": TARGET_STATE_RATIO, "ok": ok, "line": line}],
            "lines": lines}


# --------------------------------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISS"


def state_ratio(state: dict[str, list[dict[str, int]]]) -> float:
    """FSDP2's per-rank total over DDP's, on the worst rank."""
    return max(fsdp["total"] / ddp["total"] for ddp, fsdp in zip(state["ddp"], state["fsdp2"]))


def targets(state: dict[str, list[dict[str, int]]], activations: dict) -> list[dict]:
    """The two targets, each with its value, its limit and its verdict."""
    ratio, saved = state_ratio(state), activations["saved_ratio"]
    return [{"name": "state", "value": ratio, "limit": TARGET_STATE_RATIO, "ok": ratio <= TARGET_STATE_RATIO,
             "line": f"(1) FSDP2 per-rank state <= {TARGET_STATE_RATIO}x DDP's at {WORLD_SIZE} ranks: {ratio:.3f}x "
                     f"-> {verdict(ratio <= TARGET_STATE_RATIO)}"},
            {"name": "saved", "value": saved, "limit": TARGET_SAVED_RATIO, "ok": saved <= TARGET_SAVED_RATIO,
             "line": f"(2) activation checkpointing saved bytes <= {TARGET_SAVED_RATIO}x without: {saved:.3f}x -> "
                     f"{verdict(saved <= TARGET_SAVED_RATIO)}"}]


def batch_line(batch: dict) -> str:
    real = int((batch["pack_segment_ids"] >= 0).sum())
    return (f"{int(batch['source_sample_num'].sum())} samples, {real} real tokens of {batch['input_ids'].shape[1]}, "
            f"{int(batch['media_tokens'].sum())} image tokens")


def report(args, model_cfg: dict, attention: str, batches: dict, state: dict, activations: dict,
           seconds: float) -> dict:
    """The header, the two tables, the targets and the cost as lines, with every number behind them."""
    text, vision = model_cfg["config"]["text_config"], model_cfg["config"]["vision_config"]
    lines = [f"recipe {RECIPE} widened: text hidden {text['hidden_size']}, intermediate {text['intermediate_size']}, "
             f"layers {text['num_hidden_layers']}, heads {text['num_attention_heads']} (kv "
             f"{text['num_key_value_heads']}); vision hidden {vision['hidden_size']}, layers "
             f"{vision['num_hidden_layers']}; {activations['parameters'] / 1e6:.1f} M parameters "
             f"({activations['trainable'] / 1e6:.1f} M trainable), fp32 on CPU, attention {attention}, torch threads "
             f"{args.threads}",
             f"state per rank after one AdamW step ({WORLD_SIZE} ranks, gloo; one packed micro-batch each, L="
             f"{args.state_length}), bytes counted from tensors (a DTensor: its local shard):",
             f"  {'mode':<6s} {'rank':>4s} {'params MiB':>11s} {'grads MiB':>10s} {'optim MiB':>10s} "
             f"{'total MiB':>10s}"]
    for mode in STATE_MODES:
        for rank, numbers in enumerate(state[mode]):
            lines.append(f"  {mode:<6s} {rank:>4d} {numbers['parameters'] / MIB:>11.1f} "
                         f"{numbers['gradients'] / MIB:>10.1f} {numbers['optimizer'] / MIB:>10.1f} "
                         f"{numbers['total'] / MIB:>10.1f}")
    lines += [f"activations of one packed micro-batch at L={args.length} ({batch_line(batches['activations'])}): "
              f"bytes saved for backward, step = prepare + forward + loss + backward, best of {args.repeats} after "
              "1 untimed step",
              f"  {'mode':<14s} {'saved MiB':>10s} {'step s':>8s} {'loss':>10s}"]
    for mode in ACTIVATION_MODES:
        numbers = activations[mode]
        lines.append(f"  {mode:<14s} {numbers['saved_bytes'] / MIB:>10.1f} {numbers['step_s']:>8.2f} "
                     f"{numbers['loss']:>10.6f}")
    found = targets(state, activations)
    exact = activations["loss_diff"] <= EXACT_TOL and activations["grad_diff"] <= EXACT_TOL
    lines += ["targets:", *(f"  {t['line']}" for t in found),
              f"cost: a step with recomputation takes {activations['step_ratio']:.3f}x the step without",
              f"same training: loss diff {activations['loss_diff']:.1e}, max grad diff {activations['grad_diff']:.1e} "
              f"(<= {EXACT_TOL:.0e}) -> {verdict(exact)}",
              f"bench time {seconds:.1f} s"]
    return {"recipe": RECIPE, "model": model_cfg["config"], "attention": attention, "args": vars(args),
            "state": state, "state_ratio": state_ratio(state), "activations": activations, "targets": found,
            "exact": exact, "ok": all(t["ok"] for t in found) and exact, "seconds": seconds, "lines": lines}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="tokens of the activation micro-batch")
    parser.add_argument("--state-length", type=int, default=512, help="tokens of each rank's micro-batch")
    parser.add_argument("--samples", type=int, default=64, help="demo records planned")
    for name, default in (("hidden", 768), ("intermediate", 2560), ("layers", 12), ("heads", 12), ("kv-heads", 4),
                          ("vision-hidden", 384), ("vision-intermediate", 1536), ("vision-layers", 4),
                          ("vision-heads", 6)):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"model size: {name}")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per mode; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process")
    parser.add_argument("--seed", type=int, default=0, help="weights and the demo plan")
    parser.add_argument("--workdir", type=Path, help="demo data and rank outputs (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--loss", action="store_true", help="the loss alone: full vs chunked (the table above)")
    parser.add_argument("--experts", action="store_true", help="a MoE model's expert state per rank, EP 2 vs none")
    parser.add_argument("--num-experts", type=int, default=16, help="--experts: experts per MoE layer")
    parser.add_argument("--moe-intermediate", type=int, default=256, help="--experts: each expert's intermediate")
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(LOSS_VOCABS), help="--loss: vocabularies")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LOSS_LENGTHS), help="--loss: lengths")
    parser.add_argument("--loss-hidden", type=int, default=64, help="--loss: the hidden size the head projects")
    parser.add_argument("--chunk-tokens", type=int, default=TrainSpec.loss_chunk_tokens, help="--loss: chunk")
    parser.add_argument("--budget-gib", type=float, default=LOSS_BUDGET_GIB,
                        help="--loss: full runs only where its computed bytes fit")
    parser.add_argument("--step", action="store_true", help="a whole training step, full vs chunked loss")
    parser.add_argument("--step-length", type=int, default=STEP_LENGTH, help="--step: packed tokens")
    parser.add_argument("--step-vocab", type=int, default=STEP_VOCAB, help="--step: the widened vocabulary")
    parser.add_argument("--step-layers", type=int, default=STEP_LAYERS, help="--step: the model's layers")
    parser.add_argument("--step-samples", type=int, default=STEP_SAMPLES, help="--step: demo records planned")
    args = parser.parse_args(argv)
    if min(args.length, args.state_length, args.samples, args.repeats, args.threads, args.layers,
           args.vision_layers) < 1:
        parser.error("lengths, --samples, --repeats, --threads and layer counts must be >= 1")
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(RECIPE)
    model_cfg, state_specs = run_specs(args, recipe, workdir, args.state_length)
    _, activation_specs = run_specs(args, recipe, workdir, args.length)
    batches = {"state": fullest_batches(recipe, model_cfg, state_specs, WORLD_SIZE),
               "activations": fullest_batches(recipe, model_cfg, activation_specs, 1)[0]}
    progress(f"state: {WORLD_SIZE} ranks, {', '.join(STATE_MODES)}")
    state = measure_state(model_cfg, state_specs.attention, batches["state"], state_specs.train, args.threads,
                          workdir)
    progress(f"activations at L={args.length}: {', '.join(ACTIVATION_MODES)}")
    activations = measure_activations(recipe, model_cfg, activation_specs.attention, batches["activations"],
                                      args.repeats)
    return report(args, model_cfg, activation_specs.attention, batches, state, activations,
                  time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        mode = run_experts if args.experts else run_step if args.step else run
        if args.loss:
            result = run_loss(args)
        elif args.workdir is None:
            with tempfile.TemporaryDirectory() as workdir:
                result = mode(args, Path(workdir))
        else:
            args.workdir.mkdir(parents=True, exist_ok=True)
            # absolute: the ranks' file:// rendezvous needs it
            result = mode(args, args.workdir.resolve())
    finally:
        torch.set_num_threads(threads)  # called in process (tests), leave the caller's setting as it was
    print("\n".join(result["lines"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
