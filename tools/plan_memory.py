"""Will my run fit? Per-rank memory of one training step of a recipe's model at its published size, and the lever to
pull next when it does not fit.

The model is the recipe's own, built as a planning run builds it (``run_model.prepare_model`` with purpose
``plan``: on the meta device, no weights, LoRA adapters and freezing applied) from the family's transformers config
with the published dimensions of a preset (:data:`PRESETS`) or any Hydra overrides of the recipe's ``model.config``;
the bytes come from ``mvp_engine.engine.memory_plan`` (its docstring says what each term is and how it is counted;
``tests/test_plan_memory.py`` checks the activation and loss terms against bytes counted on the CPU within 10 %).
Vision positions per media token come from the recipe's cost profile (``flops.planning_cost_profile``).

    python tools/plan_memory.py --preset qwen2.5-vl-7b --world-size 8 --length 32768 [--sharding fsdp2]
        [--cp 1] [--recompute] [--loss-impl chunked|full] [--lora-r 0] [--quantization none|nf4|int8]
        [--offload none|params|optimizer] [--micro-batch 1] [--media-share 0.5] [--supervised-share 0.3]
        [--dtype float32] [--gpu-gib 80] [--levers] [--json PATH] [HYDRA_OVERRIDE ...]

Prints the settings, one line per term (GiB per rank), the total against ``--gpu-gib`` and, when it does not fit,
the first lever (in :data:`LEVERS` order) that makes it fit, else the one that saves the most; ``--levers`` prints
the total with each lever pulled alone. Numbers are estimates: allocator fragmentation, communication buffers and
the CUDA context (a few GiB together) are not in them, so a total within ~10 % of the GPU is tight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from mvp_engine.engine.config import compose_config, model_spec
from mvp_engine.engine.flops import recipe_cost_profile
from mvp_engine.engine.memory_plan import GIB, ModelShape, Plan, Settings, model_shape, plan
from mvp_engine.engine.recipe import load_recipe
from mvp_engine.engine.run_model import prepare_model

TEXT, VISION = "model.config.text_config", "model.config.vision_config"
# Published dimensions (the models' config.json): the recipe, the vocabulary (the recipe's tiny model takes its
# committed tokenizer asset's) and Hydra overrides of the recipe's tiny model config
PRESETS: dict[str, tuple[str, int, list[str]]] = {
    "qwen2.5-vl-7b": ("qwen2_5_vl", 152064, [
        f"{TEXT}.hidden_size=3584", f"{TEXT}.intermediate_size=18944", f"{TEXT}.num_hidden_layers=28",
        f"{TEXT}.num_attention_heads=28", f"{TEXT}.num_key_value_heads=4",
        f"{TEXT}.rope_parameters.mrope_section=[16,24,24]", f"{VISION}.depth=32", f"{VISION}.hidden_size=1280",
        f"{VISION}.intermediate_size=3420", f"{VISION}.num_heads=16", f"{VISION}.window_size=112",
        f"{VISION}.fullatt_block_indexes=[7,15,23,31]"]),
    "qwen3-vl-32b": ("qwen3_vl", 151936, [
        f"{TEXT}.hidden_size=5120", f"{TEXT}.intermediate_size=25600", f"{TEXT}.num_hidden_layers=64",
        f"{TEXT}.num_attention_heads=64", f"{TEXT}.num_key_value_heads=8", f"{TEXT}.head_dim=128",
        f"{TEXT}.rope_parameters.mrope_section=[24,20,20]", f"{VISION}.depth=27", f"{VISION}.hidden_size=1152",
        f"{VISION}.intermediate_size=4304", f"{VISION}.num_heads=16", f"{VISION}.patch_size=16",
        f"{VISION}.deepstack_visual_indexes=[8,16,24]", f"{VISION}.num_position_embeddings=2304"]),
    "gemma3-27b": ("gemma3", 262208, [
        "model.config.mm_tokens_per_image=256", f"{TEXT}.hidden_size=5376", f"{TEXT}.intermediate_size=21504",
        f"{TEXT}.num_hidden_layers=62", f"~{TEXT}.layer_types", f"{TEXT}.sliding_window=1024",
        f"{TEXT}.num_attention_heads=32", f"{TEXT}.num_key_value_heads=16", f"{TEXT}.head_dim=128",
        f"{TEXT}.query_pre_attn_scalar=168", f"{VISION}.hidden_size=1152", f"{VISION}.intermediate_size=4304",
        f"{VISION}.num_hidden_layers=27", f"{VISION}.num_attention_heads=16", f"{VISION}.image_size=896"]),
}
# the levers, cheapest first: (name, what it sets, what it costs)
LEVERS: tuple[tuple[str, dict, str], ...] = (
    ("train.loss_impl=chunked", {"loss_impl": "chunked"}, "none: the same loss"),
    ("train.activation_checkpointing=true", {"recompute": True}, "one more forward per step (~30 % time)"),
    ("train.sharding=fsdp2", {"sharding": "fsdp2"}, "a gather per unit per micro-batch"),
    ("train.context_parallel_size=2", {"cp": 2}, "half the data-parallel ranks, two all-to-alls per layer"),
    ("train.offload=optimizer", {"offload": "optimizer"},
     "each step's gradients copied to the host and parameters back, the AdamW step on the host"),
    ("train.offload=params", {"offload": "params", "sharding": "fsdp2"},
     "every unit copied from the host each pass, the optimizer step on the host"),
    ("model.lora.r=16", {"lora": True}, "trains adapters, not the model"),
    ("+model.quantization=nf4 (with LoRA)", {"lora": True, "quantization": "nf4", "sharding": "none",
                                             "offload": "none"}, "a 4-bit base dequantized per use; DDP, not FSDP2"),
)
LORA_R = 16


def with_vocab(model: torch.nn.Module, vocab: int | None) -> None:
    """Resize the (meta) model's embeddings and head to ``vocab`` rows, keeping whether they train."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if vocab is None or vocab == inner.config.get_text_config().vocab_size:
        return
    trains = {id(m): m.weight.requires_grad for m in (inner.get_input_embeddings(), inner.get_output_embeddings())}
    flags = list(trains.values())
    inner.resize_token_embeddings(vocab, mean_resizing=False)
    for module, flag in zip((inner.get_input_embeddings(), inner.get_output_embeddings()), flags):
        module.weight.requires_grad_(flag)


def build_shape(recipe_name: str, vocab: int | None, overrides: list[str], lora_r: int, dtype: str,
                act_bytes: int) -> tuple[ModelShape, float]:
    """The planning model of ``recipe_name`` under ``overrides`` (``vocab`` rows of embeddings, LoRA rank
    ``lora_r``, parameters in ``dtype``): its :class:`ModelShape` and vision positions per media token."""
    recipe = load_recipe(recipe_name)
    cfg = compose_config(recipe_name, [*overrides, f"model.lora.r={lora_r}", f"model.dtype={dtype}"])
    model, _ = prepare_model(recipe, cfg.model, model_spec(cfg.model), "eager", "plan")
    with_vocab(model, vocab)
    profile = recipe_cost_profile(recipe, model)
    per_token = profile.patches_per_media_token
    if profile.item_patches:  # a fixed-size image: its patches over its tokens
        per_token = profile.item_patches / int(model.config.mm_tokens_per_image)
    return model_shape(model, torch.bfloat16 if act_bytes == 2 else torch.float32), float(per_token)


def plan_lines(result: Plan, gpu_gib: float) -> list[str]:
    terms = [("parameters", result.parameters), ("gradients", result.gradients), ("optimizer state", result.optimizer),
             ("saved activations", result.activations), ("loss peak", result.loss)]
    lines = [f"  {name:<18s} {value / GIB:>8.2f} GiB" for name, value in terms]
    fits = result.total <= gpu_gib * GIB
    lines.append(f"  {'total':<18s} {result.total / GIB:>8.2f} GiB of {gpu_gib:g} GiB -> "
                 f"{'fits' if fits else 'does not fit'}")
    return lines


def pulled(settings: Settings, lever: dict) -> tuple[Settings, bool]:
    """``settings`` with a lever pulled, and whether LoRA must be on for it (the model is built again)."""
    changes = {k: v for k, v in lever.items() if k != "lora"}
    return dataclasses.replace(settings, **changes), bool(lever.get("lora"))


def next_lever(results: list[tuple[str, str, Plan]], baseline: Plan, gpu_gib: float) -> str:
    """The first lever that makes the run fit, else the one that saves the most."""
    for name, cost, result in results:
        if result.total <= gpu_gib * GIB:
            return f"next lever: {name} -> {result.total / GIB:.2f} GiB, fits (cost: {cost})"
    name, cost, result = min(results, key=lambda item: item[2].total)
    return (f"next lever: {name} -> {result.total / GIB:.2f} GiB, still over (saves "
            f"{(baseline.total - result.total) / GIB:.2f} GiB; cost: {cost}); pull it and plan again")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a published model size")
    parser.add_argument("--recipe", help="a recipe (its tiny model unless overrides widen it); default: the preset's")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--sharding", choices=("none", "fsdp2"), default="none")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks per row")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing")
    parser.add_argument("--loss-impl", choices=("full", "chunked", "liger", "cce"), default="full")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--lora-r", type=int, default=0)
    parser.add_argument("--quantization", choices=("none", "nf4", "int8"), default="none")
    parser.add_argument("--offload", choices=("none", "params", "optimizer"), default="none",
                        help="train.offload (params: FSDP2)")
    parser.add_argument("--micro-batch", type=int, default=1, help="packed rows per micro-batch")
    parser.add_argument("--length", type=int, default=32768, help="packed tokens per row")
    parser.add_argument("--media-share", type=float, default=0.5, help="share of the tokens that are media tokens")
    parser.add_argument("--supervised-share", type=float, default=0.3, help="share of the tokens supervised")
    parser.add_argument("--dtype", default="float32", help="model.dtype: the parameters' (fp32 master weights)")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16", help="train.mixed_precision")
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--levers", action="store_true", help="print the total with each lever pulled alone")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe's model")
    args = parser.parse_args(argv)
    if args.preset is None and args.recipe is None:
        parser.error("name --preset or --recipe")
    if args.quantization != "none" and args.lora_r < 1:
        parser.error("--quantization trains LoRA adapters on a quantized base: set --lora-r")
    if args.quantization != "none" and args.sharding == "fsdp2":
        parser.error("--quantization runs under DDP (model.quantization is refused under FSDP2): --sharding none")
    if args.offload == "params" and args.sharding != "fsdp2":
        parser.error("--offload offloads FSDP2's shards: --sharding fsdp2")
    if min(args.world_size, args.cp, args.micro_batch, args.length, args.chunk_tokens) < 1 or \
            args.world_size % args.cp:
        parser.error("sizes must be >= 1 and --cp must divide --world-size")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    recipe, vocab, overrides = PRESETS[args.preset] if args.preset else (None, None, [])
    recipe = args.recipe or recipe
    overrides = [*overrides, *args.overrides]
    act_bytes = 2 if args.precision == "bf16" else 4
    settings = Settings(world_size=args.world_size, sharding=args.sharding, cp=args.cp, recompute=args.recompute,
                        loss_impl=args.loss_impl, chunk_tokens=args.chunk_tokens, offload=args.offload,
                        quantization=args.quantization, micro_batch=args.micro_batch, length=args.length,
                        media_share=args.media_share, supervised_share=args.supervised_share, act_bytes=act_bytes)
    shapes = {args.lora_r: build_shape(recipe, vocab, overrides, args.lora_r, args.dtype, act_bytes)}
    shape, per_media = shapes[args.lora_r]
    result = plan(shape, settings, per_media)
    lines = [f"{args.preset or recipe}: {shape.parameters / 1e9:.2f} B parameters ({shape.trainable / 1e9:.3f} B "
             f"trainable, {args.dtype}), vocab {shape.vocab:,}, {shape.language.count} LM blocks, "
             f"{shape.vision.count} vision blocks",
             f"settings: {args.world_size} ranks, sharding {settings.sharding}, CP {settings.cp}, recompute "
             f"{'on' if settings.recompute else 'off'}, loss {settings.loss_impl}, LoRA r={args.lora_r}, "
             f"quantization {settings.quantization}, offload {settings.offload}, {settings.micro_batch} x "
             f"{settings.length} packed tokens ({result.tokens} per rank, {result.vision_positions} vision "
             f"positions), activations {args.precision}",
             "per rank:", *plan_lines(result, args.gpu_gib)]
    fits = result.total <= args.gpu_gib * GIB
    levers = []
    for name, lever, cost in LEVERS if args.levers or not fits else ():  # each builds a model: only when asked
        changed, lora = pulled(settings, lever)
        if changed == settings and (not lora or args.lora_r):
            continue  # already pulled
        r = args.lora_r or LORA_R if lora else args.lora_r
        if r not in shapes:
            shapes[r] = build_shape(recipe, vocab, overrides, r, "bfloat16" if lora else args.dtype, act_bytes)
        levers.append((name, cost, plan(shapes[r][0], changed, shapes[r][1])))
    if args.levers:
        lines += ["each lever alone:", *(f"  {name:<36s} {r.total / GIB:>8.2f} GiB" for name, _, r in levers)]
    if not fits and levers:
        lines.append(next_lever(levers, result, args.gpu_gib))
    out = {"preset": args.preset, "recipe": recipe, "settings": dataclasses.asdict(settings),
           "plan": {**dataclasses.asdict(result), "total": result.total}, "fits": fits,
           "levers": {name: r.total for name, _, r in levers}, "lines": lines}
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
