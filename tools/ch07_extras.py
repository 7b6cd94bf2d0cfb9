"""Chapter 7's measurements beside the training run: bfloat16 autocast, gradient accumulation's cost, and
learning-rate range tests; stored in src/groundup/results/chapter07.json under "extras".

    OMP_NUM_THREADS=1 python tools/ch07_extras.py --entry bf16-speed           # step times: native kernels
    OMP_NUM_THREADS=1 python tools/ch07_extras.py --entry accumulation-speed   # 1 x 32 rows vs 4 x 8, timed
    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 GROUNDUP_DATA_DIR=... \\
        python tools/ch07_extras.py --entry bf16-training                      # the loss reached, 3 seeds each
    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 GROUNDUP_DATA_DIR=... \\
        python tools/ch07_extras.py --entry lr-range                           # range tests, 3 seeds per shape
    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 \\
        python tools/ch07_extras.py --entry lr-rules                           # training at the rules' rates

Timings alternate the two sides (``ROUNDS`` rounds of a few steps each, after warm-up steps), so a change in the
machine's load hits both alike; each entry stores the per-round times, their medians and the ratio, the CPU's name
and its bfloat16-related flags, the thread count and PyTorch's CPU capability, because the ratio belongs to that
CPU: bfloat16 matrix products are fast only where the CPU multiplies bfloat16 natively (AVX512-BF16, AMX), and
everything around them (casts, softmax, norms, the optimizer in float32) costs the same or more.

bfloat16 autocast (``torch.autocast("cpu", dtype=torch.bfloat16)``) runs the matrix products of the forward pass
(and their gradients) in bfloat16 while the parameters, the optimizer and the loss's reductions stay in float32.
The training comparison trains chapter 7's GPT (``CHAPTER7_MODEL``, the Gutenberg corpus) for ``TRAIN_STEPS``
steps with and without autocast, seeds 0-2, and scores both in float32 on the whole validation text.

The range tests (:func:`groundup.lr_range.lr_range_test`): AdamW as the recipe uses it (weight decay 0.1 on
matrices, betas 0.9/0.99, clipping at 1), the learning rate from 1e-6 to 1 over ``RANGE_STEPS`` steps, seeds 0-2
(initial weights and batches), for recipe shape B on tiny Shakespeare (its tuned peak: 2e-3) and for chapter 7's
GPT on the Gutenberg corpus (its peak: 3e-3).

The rules checked by training (``lr-rules``): chapter 7's GPT (the cheaper of the two range-tested shapes) trained
with the bfloat16 comparison's budget (``TRAIN_STEPS`` steps, warm-up 40, cosine to a tenth, chapter 7's recipe
otherwise) at each rate the stored range tests suggest -- seed ``s`` at its own test's steepest fall, minimum / 10
and minimum -- and at the tuned peak 3e-3, seeds 0-2, each scored on the whole validation text. The tuned-peak runs
are the same computation as ``bf16-training``'s float32 side: seeds 1 and 2 are read from there, seed 0 is trained
again as a check that it reproduces the stored loss (the entry records both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from results_file import add_entry, machine

from groundup.char_data import char_corpus
from groundup.lr_range import lr_range_test, suggest_lr
from groundup.models import GPT, GPTConfig
from groundup.training import CHAPTER7_MODEL, CHAPTER7_TRAINING, TrainConfig, evaluate, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter07.json"
SECTION = "extras"
SEEDS = (0, 1, 2)
ROUNDS, WARMUP_STEPS = 7, 2
TRAIN_STEPS = 400
RANGE_STEPS, RANGE_LR = 150, (1e-6, 1.0)
SHAPE_B = dict(context_length=128, d_model=192, n_layers=4, n_heads=6, positional="rope", dropout=0.0)
WIDE = dict(context_length=128, d_model=384, n_layers=4, n_heads=6, positional="rope", dropout=0.0)
SPEED_SHAPES = {  # name: (corpus, model shape, batch size, steps per round and side)
    "chapter 7 (d_M 128, 4 layers, context 64, batch 12)": ("shakespeare", CHAPTER7_MODEL, 12, 5),
    "shape B (d_M 192, 4 layers, context 128, batch 8)": ("tinyshakespeare", SHAPE_B, 8, 3),
    "wider (d_M 384, 4 layers, context 128, batch 8)": ("tinyshakespeare", WIDE, 8, 2),
}
MATMUL_SIZES = (128, 512, 2048)
SUGGESTIONS_RULE = ("groundup.lr_range.suggest_lr on the stored losses: centred moving average of 9 steps, the last 5 "
                    "steps left out; steepest = fastest fall against log lr, minimum_over_10 = a tenth of the lowest")
ENTRIES = ("bf16-speed", "bf16-training", "accumulation-speed", "lr-range", "lr-rules")
RULES = ("steepest", "minimum_over_10", "minimum", "tuned_peak")


def model_for(vocab_size: int, shape: dict, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, **{**shape, "dropout": 0.0}))


def alternate(sides: dict, rounds: int = ROUNDS) -> dict:
    """Time each side (a function running some work) once per round, sides in turn; medians and ratio."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _step_fn(model, optimizer, x, y, steps: int, autocast: bool):
    def run():
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return run


def bf16_speed() -> dict:
    """Training-step times with and without autocast for three model widths, and bare matrix products."""
    result = {"machine": machine(), "rounds": ROUNDS, "models": {}, "matmul": {}}
    for label, (name, shape, batch, steps) in SPEED_SHAPES.items():
        tokenizer, train_ids, _ = char_corpus(name)
        x, y = (t for t in _batch(train_ids, batch, shape["context_length"]))
        sides = {}
        for side, autocast in (("float32", False), ("bfloat16 autocast", True)):
            model = model_for(tokenizer.vocab_size, shape, 0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            fn = _step_fn(model, optimizer, x, y, steps, autocast)
            _step_fn(model, optimizer, x, y, WARMUP_STEPS, autocast)()
            sides[side] = fn
        times = alternate(sides)
        per_step = {side: [t / steps for t in ts] for side, ts in times.items()}
        result["models"][label] = _summary(per_step, "seconds per training step",
                                           params=sum(p.numel() for p in model.parameters()))
        print(label, result["models"][label]["median"], result["models"][label]["ratio"], flush=True)
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a16, b16 = a.bfloat16(), b.bfloat16()
        reps = max(1, int(2e9 // (2 * n ** 3)))
        sides = {"float32": _products(a, b, reps), "bfloat16": _products(a16, b16, reps)}
        for fn in sides.values():
            fn()
        times = alternate(sides)
        per = {side: [t / reps for t in ts] for side, ts in times.items()}
        summary = _summary(per, f"seconds per {n}x{n} @ {n}x{n} product (tensors already in each dtype)")
        summary["gflops"] = {side: round(2 * n ** 3 / t / 1e9, 1) for side, t in summary["median"].items()}
        result["matmul"][str(n)] = summary
        print(n, summary["median"], summary["ratio"], summary["gflops"], flush=True)
    return result


def _products(a, b, reps: int):
    def run():
        for _ in range(reps):
            a @ b
    return run


def _summary(per_side: dict, unit: str, **extra) -> dict:
    medians = {side: statistics.median(ts) for side, ts in per_side.items()}
    first, second = list(medians)
    return {"unit": unit, **extra, "per_round": {s: [round(t, 6) for t in ts] for s, ts in per_side.items()},
            "median": {s: round(t, 6) for s, t in medians.items()},
            "ratio": round(medians[first] / medians[second], 3),
            "ratio_means": f"median {first} / median {second}: above 1, the second side is faster"}


def _batch(train_ids, batch: int, context: int):
    from groundup.data import get_batch
    return get_batch(train_ids, batch, context, generator=torch.Generator().manual_seed(0))


SIDES = ("float32", "bfloat16 autocast", "one autocast context around train (wrong)")


def autocast_forward(model) -> None:
    """Run every call of ``model`` inside its own bfloat16 autocast context (the forward only: the backward and
    the optimizer run outside). Autocast keeps the bfloat16 copies of the weights it casts until its context
    exits, so a context must end after each forward, or the next steps would reuse stale weights."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward.__get__(model))


def train_side(side: str, model, train_ids, val_ids, config):
    """Train ``model`` as ``side`` of SIDES says; train's History."""
    if side == "bfloat16 autocast":
        autocast_forward(model)
        try:
            return train(model, train_ids, val_ids, config)
        finally:
            del model.forward
    if side == SIDES[2]:  # the pitfall: the cached bfloat16 weights are cast once and reused for every step
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return train(model, train_ids, val_ids, config)
    return train(model, train_ids, val_ids, config)


def bf16_training() -> dict:
    """Chapter 7's GPT for TRAIN_STEPS steps, float32 vs bfloat16 autocast (seeds 0-2) and the pitfall (seed 0),
    each scored in float32 on the whole validation text."""
    tokenizer, train_ids, val_ids = char_corpus("shakespeare")
    base = {**CHAPTER7_TRAINING, "max_steps": TRAIN_STEPS, "warmup_steps": 40, "eval_interval": 100,
            "progress": False}
    runs = {}
    plan = [(seed, side) for seed in SEEDS for side in SIDES[:2]] + [(0, SIDES[2])]
    for seed, side in plan:
        model = model_for(tokenizer.vocab_size, CHAPTER7_MODEL, seed)
        config = TrainConfig(**{**base, "seed": seed})
        start = time.perf_counter()
        history = train_side(side, model, train_ids, val_ids, config)
        seconds = time.perf_counter() - start
        full = evaluate(model, val_ids, batch_size=64)  # float32, outside autocast
        runs[f"{side}/seed{seed}"] = {
            "side": side, "seed": seed, "eval_step": history.eval_step,
            "val_loss_20_batches": [round(v, 5) for v in history.val_loss],
            "final_train_loss_mean_last_50": round(statistics.fmean(history.train_loss[-50:]), 5),
            "full_val_loss_float32": round(full, 5), "seconds": round(seconds, 1)}
        print(side, seed, runs[f"{side}/seed{seed}"]["full_val_loss_float32"], round(seconds, 1), flush=True)
    finals = {side: [runs[f"{side}/seed{s}"]["full_val_loss_float32"] for s in SEEDS] for side in SIDES[:2]}
    return {"machine": machine(), "corpus": "shakespeare (Gutenberg, 42 works; last 10 % for validation)",
            "model": CHAPTER7_MODEL, "training": {k: v for k, v in base.items() if k != "progress"},
            "note": "bfloat16 autocast wraps each forward call of the model (train's evaluations included: their "
                    "20-batch curve is computed in bfloat16); the backward and AdamW run outside it. The third side "
                    "wraps the whole call of train in one autocast context, which keeps the bfloat16 copies of the "
                    "weights cast at the first step for every later step. full_val_loss_float32 scores every final "
                    "model in float32 on the whole validation text; seconds include the evaluations and are not "
                    "comparable timings (the machine was shared; see bf16_speed)",
            "runs": runs, "final_mean": {s: round(statistics.fmean(v), 5) for s, v in finals.items()},
            "final_sd": {s: round(statistics.stdev(v), 5) for s, v in finals.items()}}


def accumulate_gradients(model, x, y, parts: int) -> float:
    """Leave in ``model``'s parameters the gradient of the mean loss over the batch ``(x, y)``, computed as
    ``parts`` equal micro-batches whose losses, each divided by ``parts``, are backpropagated in turn; return that
    mean loss. Every window counts as many targets, so the mean of the micro-batches' means is the batch's mean."""
    if x.shape[0] % parts:
        raise ValueError(f"the batch's {x.shape[0]} rows do not split into {parts} equal micro-batches")
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
        _, loss = model(xs, ys)
        (loss / parts).backward()
        total += loss.item() / parts
    return total


def accumulation_speed() -> dict:
    """One step of 32 rows against 4 micro-batches of 8 accumulated, chapter 7's GPT, forward and backward."""
    tokenizer, train_ids, _ = char_corpus("shakespeare")
    model = model_for(tokenizer.vocab_size, CHAPTER7_MODEL, 0)
    x, y = _batch(train_ids, 32, CHAPTER7_MODEL["context_length"])

    sides = {"1 x 32 rows": lambda: accumulate_gradients(model, x, y, 1),
             "4 x 8 rows accumulated": lambda: accumulate_gradients(model, x, y, 4)}
    for fn in sides.values():
        fn()
    times = alternate({k: (lambda f=f: [f() for _ in range(3)]) for k, f in sides.items()})
    per = {side: [t / 3 for t in ts] for side, ts in times.items()}
    return {"machine": machine(), "model": CHAPTER7_MODEL,
            **_summary(per, "seconds per forward and backward of 32 rows of 64 tokens")}


def lr_range() -> dict:
    """Range tests for shape B (tiny Shakespeare) and chapter 7's GPT (Gutenberg), seeds 0-2."""
    setups = {"shape B": ("tinyshakespeare", SHAPE_B, 8, 2e-3), "chapter 7": ("shakespeare", CHAPTER7_MODEL, 12, 3e-3)}
    result = {"machine": machine(), "steps": RANGE_STEPS, "lr_min": RANGE_LR[0], "lr_max": RANGE_LR[1],
              "optimizer": "adamw, betas (0.9, 0.99), weight decay 0.1 on matrices, clipping at 1, no warm-up",
              "stop_factor": 4.0, "suggestions_rule": SUGGESTIONS_RULE, "setups": {}}
    for label, (name, shape, batch, tuned) in setups.items():
        tokenizer, train_ids, _ = char_corpus(name)
        runs = {}
        for seed in SEEDS:
            model = model_for(tokenizer.vocab_size, shape, seed)
            config = TrainConfig(batch_size=batch, context_length=shape["context_length"], seed=seed, progress=False)
            lrs, losses = lr_range_test(model, train_ids, config, lr_min=RANGE_LR[0], lr_max=RANGE_LR[1],
                                        steps=RANGE_STEPS)
            losses = [round(v, 4) for v in losses]  # the suggestions are read off the stored numbers
            runs[f"seed{seed}"] = {"losses": losses, "stopped_at": len(losses),
                                   "suggestions": {k: float(f"{v:.3g}") for k, v in suggest_lr(lrs, losses).items()}}
            print(label, seed, len(losses), runs[f"seed{seed}"]["suggestions"], flush=True)
        result["setups"][label] = {"corpus": name, "model": shape, "batch_size": batch, "tuned_peak_lr": tuned,
                                   "runs": runs}
    return result


def rule_rates(setup: dict, seed: int) -> dict:
    """The learning rate of each of RULES for ``seed``: its own range test's suggestions, and the tuned peak."""
    return {**{rule: setup["runs"][f"seed{seed}"]["suggestions"][rule] for rule in RULES[:3]},
            "tuned_peak": setup["tuned_peak_lr"]}


def lr_rules() -> dict:
    """Chapter 7's GPT for TRAIN_STEPS steps at the rates of RULES (seeds 0-2), scored on the whole validation text.

    The tuned peak's runs are bf16-training's float32 runs (the same model, seeds, configuration and arithmetic):
    seeds 1 and 2 are taken from that entry, and seed 0 is trained again to check that it gives the same loss."""
    stored = json.loads(OUT.read_text())[SECTION]
    setup, bf16 = stored["lr_range"]["setups"]["chapter 7"], stored["bf16_training"]
    tokenizer, train_ids, val_ids = char_corpus("shakespeare")
    base = {**CHAPTER7_TRAINING, "max_steps": TRAIN_STEPS, "warmup_steps": 40, "eval_interval": 100,
            "progress": False}
    if bf16["training"] != {k: v for k, v in base.items() if k != "progress"}:
        raise ValueError(f"bf16_training was trained with {bf16['training']}, not {base}: run all four rules")
    runs = {}
    for seed in SEEDS:
        for rule, lr in rule_rates(setup, seed).items():
            if rule == "tuned_peak" and seed != 0:
                old = bf16["runs"][f"float32/seed{seed}"]
                runs[f"{rule}/seed{seed}"] = {
                    "rule": rule, "seed": seed, "lr": lr, "eval_step": old["eval_step"],
                    "val_loss_20_batches": old["val_loss_20_batches"], "full_val_loss": old["full_val_loss_float32"],
                    "from": f"extras.bf16_training.runs['float32/seed{seed}']"}
                continue
            model = model_for(tokenizer.vocab_size, CHAPTER7_MODEL, seed)
            start = time.perf_counter()
            history = train(model, train_ids, val_ids, TrainConfig(**{**base, "seed": seed, "learning_rate": lr}))
            full = evaluate(model, val_ids, batch_size=64)
            runs[f"{rule}/seed{seed}"] = {
                "rule": rule, "seed": seed, "lr": lr, "eval_step": history.eval_step,
                "val_loss_20_batches": [round(v, 5) for v in history.val_loss], "full_val_loss": round(full, 5),
                "seconds": round(time.perf_counter() - start, 1)}
            print(rule, seed, lr, runs[f"{rule}/seed{seed}"]["full_val_loss"], runs[f"{rule}/seed{seed}"]["seconds"],
                  flush=True)
    finals = {rule: [runs[f"{rule}/seed{s}"]["full_val_loss"] for s in SEEDS] for rule in RULES}
    check = {"trained_again": runs["tuned_peak/seed0"]["full_val_loss"],
             "bf16_training": bf16["runs"]["float32/seed0"]["full_val_loss_float32"]}
    return {"machine": machine(), "corpus": "shakespeare (Gutenberg, 42 works; last 10 % for validation)",
            "model": CHAPTER7_MODEL, "training": {k: v for k, v in base.items() if k not in ("progress", "seed")},
            "rates_from": "extras.lr_range.setups['chapter 7']: seed s at its own range test's suggestions "
                          "(stored to 3 significant digits); tuned_peak is chapter 7's 3e-3 for every seed",
            "tuned_peak_seed0_check": {**check, "equal": check["trained_again"] == check["bf16_training"]},
            "runs": runs, "final_mean": {r: round(statistics.fmean(v), 5) for r, v in finals.items()},
            "final_sd": {r: round(statistics.stdev(v), 5) for r, v in finals.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES, required=True)
    a = p.parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")
                   if k in os.environ)
    make = {"bf16-speed": bf16_speed, "bf16-training": bf16_training, "accumulation-speed": accumulation_speed,
            "lr-range": lr_range, "lr-rules": lr_rules}[a.entry]
    start = time.perf_counter()
    entry = make()
    entry["command"] = f"{env} python tools/ch07_extras.py --entry {a.entry}".strip()
    entry["wall_seconds"] = round(time.perf_counter() - start, 1)
    add_entry(OUT, a.entry.replace("-", "_"), entry, section=SECTION)
    print(f"stored {a.entry} in {OUT} (section {SECTION!r}) after {entry['wall_seconds']} s")


if __name__ == "__main__":
    main()
