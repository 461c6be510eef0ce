"""Preference pairs, the prefix shared against duplicated: tokens and vision work per pair over a preference set, and
the DPO step (time, peak memory, loss) packed shared vs packed duplicated vs unpacked, on the same pairs and weights.

Why: packed DPO is worth doing with the prompt shared only if it saves work at the same loss; the target (issue 32)
is >= 1.5x fewer tokens processed per pair than duplicating the prefix, on a set with image prompts and short
answers, at identical loss.

1. Tokens per pair, measured on every pair of the set through the run's encoder from text and image headers alone
   (``PairEncoder.measure``): the prefix shared (one packing item holding the prompt and its images once, both
   answers after it) and duplicated (each answer after its own copy of the prompt); tokens per pair and image
   tokens per pair (what the vision tower encodes), and their ratios.
2. One DPO step of the first ``--step-pairs`` pairs that carry an image and fit ``--max-pair-tokens`` (duplicated),
   the recipe's model (its tiny config with the overrides; fp32, seeded), sigmoid DPO against a frozen reference
   (the same model built from the next seed): reference forward (no grad) + policy forward + the loss + backward,
   in four layouts of the same pairs:

   - ``shared``: the pairs packed into one row, each prefix once (the engine's ``PreferenceObjective`` on the
     recipe's ``prepare_packed``, the run's attention);
   - ``duplicated``: the same, each pair as its two whole conversations (``dpo.shared_prefix=false``);
   - ``pair_by_pair`` (unpacked): one pair at a time, its chosen and rejected conversation as two rows padded to
     the longer (``prepare_padded``; TRL's concatenated forward), a backward per pair, the gradients accumulated;
   - ``padded_batch`` (unpacked): every conversation of the step its own row, padded to the longest, one backward;

   the unpacked layouts through the same chunked log-prob path and ``preference_losses``.

   Each layout first runs one untimed step, then one step under the profiler for its peak added memory (CPU
   allocation events in time order, ``peak_memory.peak_added_bytes``: activations, the gradients, the reference
   forward), then ``--repeats`` timed steps, the layouts interleaved; the fastest counts. The loss of each must
   agree: max relative difference <= 1e-5 (fp32) is "identical loss".

Targets, each printed with its value and OK/MISS: tokens per pair duplicated / shared >= 1.5x; identical loss.

Usage: ``python tools/bench_pairs.py [--recipe llava] [--pairs pairs.jsonl] [--step-pairs 8] [--repeats 3]
[--max-pair-tokens 1024] [--threads 1] [--no-step] [overrides ...]``; without ``--pairs`` the demo preference set
(``demo.*`` overrides apply: the demo set as LLaMA-Factory pairs, each conversation's own answer chosen, the next
one's rejected). The LLaVA default (``DEFAULT_OVERRIDES``) makes its tiny model's images 224 px, 256 tokens each
(released LLaVA-1.5: 576), so the demo set has image prompts of the size the target speaks of. ``main(argv)``
returns every number as a dict.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mvp_engine.engine.config import PreferenceSpec, compose_config, resolve_run_specs
from mvp_engine.engine.demo import with_demo_data
from mvp_engine.engine.linear_loss import HeadInputs
from mvp_engine.engine.peak_memory import peak_added_bytes
from mvp_engine.engine.preference import PairLogProbs, PreferenceObjective, frozen_copy, preference_losses
from mvp_engine.engine.recipe import Recipe, load_recipe
from mvp_engine.kit.mllm.data import IGNORE_INDEX, MLLMCollator, MLLMPack
from mvp_engine.kit.mllm.data.pairs import PairEncoder
from mvp_engine.kit.mllm.data.preference_sources import read_preference_records
from mvp_engine.kit.mllm.data.sources import MLLMRecordError

TARGET_TOKENS_RATIO = 1.5
LOSS_TOL = 1e-5  # relative, fp32
DEFAULT_OVERRIDES = {"llava": ["model.config.vision_config.image_size=224"]}  # 16 x 16 patches of 14 px
LAYOUTS = ("shared", "duplicated", "pair_by_pair", "padded_batch")
UNPACKED = ("pair_by_pair", "padded_batch")
BETA = 0.1
MIB = 2**20


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISS"


def read_set(recipe_name: str, pairs_path: str | None, overrides: list[str]):
    """The run's config (dpo, packed, fp32), the recipe and every pair of the set."""
    cfg = compose_config(recipe_name, ["train.objective=dpo", "+packing=greedy", "model.dtype=float32",
                                       *DEFAULT_OVERRIDES.get(recipe_name, []), *overrides])
    if pairs_path is not None:
        cfg.data.sources = [pairs_path]
    cfg = with_demo_data(cfg)
    records = [r for source in cfg.data.sources for r in read_preference_records(source, on_bad=lambda err: None)]
    return cfg, load_recipe(recipe_name), records


def measure_tokens(encoder, records) -> dict[str, dict[str, float]]:
    """Per layout: the pairs measured, mean tokens and image tokens per pair."""
    out = {}
    for name, shared in (("shared", True), ("duplicated", False)):
        pair_encoder = PairEncoder(encoder, shared_prefix=shared)
        metas = []
        for record in records:
            try:
                metas.append(pair_encoder.measure(record))
            except MLLMRecordError:
                continue
        out[name] = {"pairs": len(metas), "tokens": statistics.fmean(m.length for m in metas),
                     "image_tokens": statistics.fmean(m.media_tokens for m in metas)}
    return out


# ----------------------------------------------------------------------------------------------- the DPO step


def step_batches(encoder, pad: int, records, count: int, max_tokens: int) -> tuple[dict[str, list[dict]], int]:
    """Each layout's micro-batches of the first ``count`` pairs with an image whose duplicated item fits
    ``max_tokens``, and how many pairs that is."""
    shared, duplicated = PairEncoder(encoder, True), PairEncoder(encoder, False)
    chosen = []
    for record in records:
        try:
            pair = duplicated.encode(record)
            if pair.num_media == 0 or pair.length > max_tokens:
                continue
            chosen.append((shared.encode(record), pair, duplicated.unpaired(record)))
        except MLLMRecordError:
            continue
        if len(chosen) == count:
            break
    if not chosen:
        raise SystemExit(f"no pair with an image fits --max-pair-tokens {max_tokens}")
    collate = MLLMCollator(pad).__call__
    def rows(conversations):
        return collate([MLLMPack([conversation]).to_model_inputs() for conversation in conversations])

    batches = {"shared": [collate([MLLMPack([c[0] for c in chosen]).to_model_inputs()])],
               "duplicated": [collate([MLLMPack([c[1] for c in chosen]).to_model_inputs()])],
               "pair_by_pair": [rows(c[2]) for c in chosen],
               "padded_batch": [rows([conversation for c in chosen for conversation in c[2]])]}
    return batches, len(chosen)


def padded_logprobs(recipe: Recipe, model, batch: dict, attention: str) -> PairLogProbs:
    """Each row's summed answer log-probability and token count through the chunked path; rows alternate chosen,
    rejected."""
    with HeadInputs(model) as head:
        outputs = model(**recipe.prepare_padded(batch, model, attention))
    tokens = head.token_logprobs(outputs.logits, batch["labels"])
    sums, counts = tokens.sum(1), (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).to(tokens.dtype)
    return PairLogProbs(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def dpo_step(layout: str, recipe: Recipe, model, reference, batches: list[dict], attention: str,
             spec: PreferenceSpec, pairs: int) -> float:
    """One step of ``layout`` over its micro-batches from no gradients: per micro-batch the reference (no grad),
    the policy, its pairs' summed loss over the step's ``pairs``, backward; the step's loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        if layout in UNPACKED:
            with torch.no_grad():
                ref = padded_logprobs(recipe, reference, batch, attention)
            loss = preference_losses(padded_logprobs(recipe, model, batch, attention), ref, spec)[0].sum() / pairs
        else:
            part, _ = PreferenceObjective(spec, reference).loss(
                model, batch, lambda m, b: (m(**recipe.prepare_packed(b, m, attention)), None))
            loss = part.weighted_sum / pairs
        loss.backward()
        total += float(loss.detach())
    return total


def measure_steps(cfg, recipe: Recipe, records, args: argparse.Namespace) -> dict:
    """Each layout's step on the same pairs and weights: loss, peak added bytes, best and every timed step."""
    specs = resolve_run_specs(cfg, recipe.attention_backends)
    processor = recipe.build_processor(cfg.model)
    batches, pairs = step_batches(recipe.build_encoder(processor), recipe.pad_token_id(processor), records,
                                  args.step_pairs, args.max_pair_tokens)
    model = recipe.build_model(cfg.model, specs.attention)
    cfg.model.seed = int(cfg.model.seed) + 1
    reference = frozen_copy(recipe.build_model(cfg.model, specs.attention))
    spec = PreferenceSpec(beta=BETA, reference="copy")
    out: dict = {"pairs": pairs, "attention": specs.attention, "layouts": {}}
    for layout in LAYOUTS:
        def step(layout=layout):
            return dpo_step(layout, recipe, model, reference, batches[layout], specs.attention, spec, pairs)

        loss = step()  # warm-up: one-off costs
        widths = [batch["input_ids"].shape[1] for batch in batches[layout]]
        out["layouts"][layout] = {"loss": loss, "peak_bytes": peak_added_bytes(step), "times_s": [],
                                  "micro_batches": len(widths), "rows": batches[layout][0]["input_ids"].shape[0],
                                  "width": max(widths),
                                  "slots": sum(batch["input_ids"].numel() for batch in batches[layout])}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            start = time.perf_counter()
            dpo_step(layout, recipe, model, reference, batches[layout], specs.attention, spec, pairs)
            out["layouts"][layout]["times_s"].append(time.perf_counter() - start)
    for row in out["layouts"].values():
        row["step_s"] = min(row["times_s"])
    base = out["layouts"]["shared"]["loss"]
    out["loss_diff"] = max(abs(row["loss"] - base) / max(abs(base), 1e-30) for row in out["layouts"].values())
    return out


# -------------------------------------------------------------------------------------------------- report


def report(recipe_name: str, tokens: dict, steps: dict | None, args: argparse.Namespace) -> dict:
    shared, duplicated = tokens["shared"], tokens["duplicated"]
    tokens_ratio = duplicated["tokens"] / shared["tokens"]
    image_ratio = duplicated["image_tokens"] / shared["image_tokens"] if shared["image_tokens"] else float("nan")
    lines = [f"{recipe_name}: {shared['pairs']} pairs measured",
             f"{'layout':<12}{'tokens/pair':>14}{'image tokens/pair':>20}"]
    lines += [f"{name:<12}{row['tokens']:>14.1f}{row['image_tokens']:>20.1f}" for name, row in tokens.items()]
    lines.append(f"duplicated / shared: tokens {tokens_ratio:.2f}x, image tokens {image_ratio:.2f}x")
    found = [{"name": "tokens", "value": tokens_ratio, "ok": tokens_ratio >= TARGET_TOKENS_RATIO,
              "line": f"tokens per pair duplicated / shared >= {TARGET_TOKENS_RATIO}x: {tokens_ratio:.2f}x -> "
                      f"{verdict(tokens_ratio >= TARGET_TOKENS_RATIO)}"}]
    if steps is not None:
        rows = steps["layouts"]
        lines += [f"DPO step of {steps['pairs']} pairs (sigmoid, beta {BETA}, frozen reference), fp32 on CPU, "
                  f"attention {steps['attention']}, torch threads {args.threads}; reference forward + policy "
                  f"forward + loss + backward, best of {args.repeats} after 1 untimed step; peak added memory from "
                  "the profiler's allocation events",
                  "(micro-batches x rows x width: the widest micro-batch)",
                  f"{'layout':<14}{'batches':>16}{'slots':>8}{'step s':>9}{'peak MiB':>10}{'loss':>12}"]
        for name, row in rows.items():
            shape = f"{row['micro_batches']} x {row['rows']} x {row['width']}"
            lines.append(f"{name:<14}{shape:>16}{row['slots']:>8}{row['step_s']:>9.3f}{row['peak_bytes'] / MIB:>10.1f}"
                         f"{row['loss']:>12.6f}")
        for name in LAYOUTS[1:]:
            lines.append(f"{name} / shared: step time {rows[name]['step_s'] / rows['shared']['step_s']:.2f}x, peak "
                         f"memory {rows[name]['peak_bytes'] / max(rows['shared']['peak_bytes'], 1):.2f}x")
        same = steps["loss_diff"] <= LOSS_TOL
        found.append({"name": "identical_loss", "value": steps["loss_diff"], "ok": same,
                      "line": f"identical loss (max relative difference <= {LOSS_TOL:.0e}): "
                              f"{steps['loss_diff']:.1e} -> {verdict(same)}"})
    lines += ["targets:", *(f"  {t['line']}" for t in found)]
    return {"recipe": recipe_name, "tokens": tokens, "tokens_ratio": tokens_ratio, "image_ratio": image_ratio,
            "steps": steps, "targets": found, "ok": all(t["ok"] for t in found), "lines": lines}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="llava")
    parser.add_argument("--pairs", default=None, help="a preference file (default: the demo preference set)")
    parser.add_argument("--step-pairs", type=int, default=8, help="pairs in the DPO step")
    parser.add_argument("--max-pair-tokens", type=int, default=1024, help="the step's pairs fit this, duplicated")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-step", action="store_true", help="tokens per pair only")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (demo.num_samples=200, model.*, ...)")
    args = parser.parse_args(argv)
    if min(args.step_pairs, args.max_pair_tokens, args.repeats, args.threads) < 1:
        parser.error("--step-pairs, --max-pair-tokens, --repeats and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        started = time.perf_counter()
        cfg, recipe, records = read_set(args.recipe, args.pairs, args.overrides)
        tokens = measure_tokens(recipe.build_encoder(recipe.build_processor(cfg.model)), records)
        steps = None if args.no_step else measure_steps(cfg, recipe, records, args)
        result = report(args.recipe, tokens, steps, args)
    finally:
        torch.set_num_threads(threads)  # called in process (tests): leave the caller's setting as it was
    result["lines"].append(f"bench time {time.perf_counter() - started:.1f} s")
    print("\n".join(result["lines"]))
    return result


if __name__ == "__main__":
    main()
