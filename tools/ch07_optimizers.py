"""Chapter 7's optimizer experiment: SGD, SGD with momentum, AdamW and Muon on one small GPT, stored in
src/groundup/results/chapter07.json under "optimizers".

    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 GROUNDUP_DATA_DIR=... \\
        python tools/ch07_optimizers.py                                    # the whole sweep, then the summary
    python tools/ch07_optimizers.py --optimizer sgd --lr 0.3 --seed 0     # one run (stored, replacing its entry)
    python tools/ch07_optimizers.py --summary                             # only recompute grid and summary

The model is of chapter 7's family, smaller (``SHAPE``: 2 layers, d_model 64, 4 heads, context 64, RoPE, no
dropout, about 0.1 M parameters) and trained on character-level tiny Shakespeare (nanoGPT's split: the last 10 %
for validation) with ``groundup.training.train``: batch 8 windows of 64 characters, ``STEPS`` steps, the
package's schedule (linear warm-up over ``WARMUP`` steps, cosine to a tenth of the peak), gradient clipping at
norm 1, one CPU thread. The four optimizers differ only in the update:

- ``sgd``: plain stochastic gradient descent, eq. (7.3) (``optimizer="sgd"``, ``beta1=0``);
- ``sgd_momentum``: SGD with heavy-ball momentum 0.9 (``optimizer="sgd"``, ``beta1=0.9``);
- ``adamw``: AdamW, betas (0.9, 0.99), weight decay 0.1 on the matrices (the package's default);
- ``muon``: Muon on the blocks' weight matrices and AdamW on the rest (``optimizer="muon"``, as the package does it).

Both SGD variants run without weight decay: ``torch.optim.SGD`` adds ``λθ`` to the gradient, so at SGD's
learning rates (0.03 to 3) the package's λ = 0.1 would shrink every matrix by 0.3 % to 30 % per step, where AdamW's
decay at its rates shrinks them by about 0.03 %.

Each optimizer's peak learning rate is tuned on seed 0 over ``GRIDS`` (log-spaced, about 3x apart): the one
with the lowest final loss on the whole validation text wins; if that is the grid's smallest or largest value,
the grid is extended by one value beyond it (up to ``MAX_EXTENSIONS`` times), so the chosen rate is inside the
grid. Seeds 1 and 2 then run at the chosen rate (the seed sets the initial weights and the batch order). Every run
stores its validation loss on 10 fixed batches before training and every ``EVAL_INTERVAL`` steps, the loss on the
whole validation text at the end, its training seconds (not reproducible: the machine was shared) and the command
that made it. The runs are deterministic on one thread with MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from results_file import add_entry

from groundup.char_data import char_corpus
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, TrainingDiverged, evaluate, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter07.json"
SECTION = "optimizers"
SHAPE = dict(context_length=64, d_model=64, n_layers=2, n_heads=4, positional="rope", dropout=0.0)
BATCH, STEPS, WARMUP, EVAL_INTERVAL, EVAL_BATCHES = 8, 600, 30, 50, 10
SEEDS = (0, 1, 2)
OPTIMIZERS = {  # name: (label, TrainConfig settings)
    "sgd": ("SGD (7.3)", dict(optimizer="sgd", beta1=0.0, weight_decay=0.0)),
    "sgd_momentum": ("SGD + momentum 0.9", dict(optimizer="sgd", beta1=0.9, weight_decay=0.0)),
    "adamw": ("AdamW", dict(optimizer="adamw")),
    "muon": ("Muon + AdamW", dict(optimizer="muon")),
}
GRIDS = {
    "sgd": [0.1, 0.3, 1.0, 3.0],
    "sgd_momentum": [0.03, 0.1, 0.3, 1.0],
    "adamw": [1e-3, 3e-3, 1e-2, 3e-2],
    "muon": [1e-3, 3e-3, 1e-2, 3e-2],
}
MAX_EXTENSIONS = 2
ENV = "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1"


def run_key(optimizer: str, lr: float, seed: int) -> str:
    return f"{optimizer}/lr{lr:g}/seed{seed}"


def final(entry: dict) -> float:
    """A run's final loss on the whole validation text; a diverged run (stored as None) counts as infinite."""
    return math.inf if entry["full_val_loss"] is None else entry["full_val_loss"]


def data():
    return char_corpus("tinyshakespeare")


def run(optimizer: str, lr: float, seed: int, tokenizer, train_ids, val_ids) -> dict:
    """One training run; a diverged run is stored with ``diverged_at`` and an infinite final loss."""
    label, settings = OPTIMIZERS[optimizer]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **SHAPE))
    config = TrainConfig(batch_size=BATCH, max_steps=STEPS, learning_rate=lr, warmup_steps=WARMUP, grad_clip=1.0,
                         eval_interval=EVAL_INTERVAL, eval_batches=EVAL_BATCHES, seed=seed, progress=False,
                         **settings)
    first = evaluate(model, val_ids, batch_size=BATCH, max_batches=EVAL_BATCHES)  # the batches train evaluates on
    entry = {"optimizer": optimizer, "label": label, "lr": lr, "seed": seed,
             "settings": dict(settings), "diverged_at": None,
             "command": f"{ENV} python tools/ch07_optimizers.py --optimizer {optimizer} --lr {lr:g} --seed {seed}"}
    start = time.perf_counter()
    try:
        history = train(model, train_ids, val_ids, config)
    except TrainingDiverged as err:
        step = re.search(r"diverged at step (\d+)", str(err))
        return {**entry, "diverged_at": int(step.group(1)) if step else None, "eval_step": [0],
                "val_loss": [round(first, 5)], "full_val_loss": None, "seconds": round(time.perf_counter() - start, 1)}
    seconds = time.perf_counter() - start
    full = evaluate(model, val_ids, batch_size=64)
    return {**entry, "eval_step": [0, *history.eval_step],
            "val_loss": [round(v, 5) for v in (first, *history.val_loss)],
            "full_val_loss": round(full, 5), "seconds": round(seconds, 1)}


def stored_runs() -> dict:
    if not OUT.exists():
        return {}
    return json.loads(OUT.read_text(encoding="utf-8")).get(SECTION, {}).get("runs", {})


def store_run(entry: dict) -> None:
    runs = stored_runs()
    runs[run_key(entry["optimizer"], entry["lr"], entry["seed"])] = entry
    add_entry(OUT, "runs", dict(sorted(runs.items())), section=SECTION)


def ensure(optimizer, lr, seed, corpus, skip_stored: bool) -> dict:
    """The stored run, or a fresh one (stored)."""
    key = run_key(optimizer, lr, seed)
    if skip_stored and key in stored_runs():
        return stored_runs()[key]
    entry = run(optimizer, lr, seed, *corpus)
    store_run(entry)
    print(f"{key}: final loss {entry['full_val_loss']} (whole validation text), {entry['seconds']} s", flush=True)
    return entry


def grid_of(optimizer: str, runs: dict) -> list[float]:
    """The grid as run: ``GRIDS`` plus the stored seed-0 runs beyond its edges."""
    extra = [r["lr"] for r in runs.values() if r["optimizer"] == optimizer and r["seed"] == 0]
    return sorted(set(GRIDS[optimizer]) | set(extra))


def next_value(grid: list[float], lower: bool) -> float:
    """One more grid value beyond the edge, at the ratio of the two values at that edge."""
    a, b = (grid[0], grid[1]) if lower else (grid[-1], grid[-2])
    return float(f"{a * a / b:.3g}")


def tune(optimizer: str, corpus, skip_stored: bool) -> float:
    grid = list(GRIDS[optimizer])
    losses = {lr: final(ensure(optimizer, lr, 0, corpus, skip_stored)) for lr in grid}
    for _ in range(MAX_EXTENSIONS):
        best = min(grid, key=losses.get)
        if best not in (grid[0], grid[-1]):
            break
        lr = next_value(grid, lower=best == grid[0])
        losses[lr] = final(ensure(optimizer, lr, 0, corpus, skip_stored))
        grid = sorted(losses)
    return min(grid, key=losses.get)


def summarise() -> None:
    """The grid of each optimizer (seed 0), the chosen rate and the three seeds' final losses, from the stored runs."""
    runs = stored_runs()
    grid, summary = {}, {}
    for optimizer, (label, _) in OPTIMIZERS.items():
        lrs = grid_of(optimizer, runs)
        if any(run_key(optimizer, lr, 0) not in runs for lr in lrs):
            continue  # not tuned yet
        finals = [runs[run_key(optimizer, lr, 0)]["full_val_loss"] for lr in lrs]
        chosen = min(lrs, key=lambda lr: final(runs[run_key(optimizer, lr, 0)]))
        grid[optimizer] = {"lr": lrs, "full_val_loss": finals, "chosen": chosen,
                           "inside": lrs[0] < chosen < lrs[-1]}
        seeds = [runs.get(run_key(optimizer, chosen, s)) for s in SEEDS]
        if all(seeds):
            finals = [final(r) for r in seeds]
            summary[optimizer] = {"label": label, "lr": chosen, "seeds": list(SEEDS), "full_val_loss": finals,
                                  "mean": round(statistics.mean(finals), 5), "sd": round(statistics.stdev(finals), 5)}
    add_entry(OUT, "about", __doc__.split("\n\n", 1)[0].replace("\n", " ") + " See tools/ch07_optimizers.py.",
              section=SECTION)
    add_entry(OUT, "setup", {"corpus": "tinyshakespeare (characters; last 10 % for validation)", "shape": SHAPE,
                             "batch_size": BATCH, "steps": STEPS, "warmup_steps": WARMUP, "min_lr": "lr / 10",
                             "grad_clip": 1.0, "eval_interval": EVAL_INTERVAL, "eval_batches": EVAL_BATCHES,
                             "tokens": BATCH * SHAPE["context_length"] * STEPS, "seeds": list(SEEDS),
                             "optimizers": {k: {"label": v[0], **v[1]} for k, v in OPTIMIZERS.items()},
                             "grids": GRIDS, "threads": 1, "arithmetic": ENV,
                             "command": f"{ENV} python tools/ch07_optimizers.py"}, section=SECTION)
    add_entry(OUT, "grid", grid, section=SECTION)
    add_entry(OUT, "summary", summary, section=SECTION)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="one optimizer (default: all four)")
    p.add_argument("--lr", type=float, help="with --optimizer and --seed: one run at this peak learning rate")
    p.add_argument("--seed", type=int, help="with --optimizer and --lr: the run's seed")
    p.add_argument("--skip-stored", action="store_true", help="keep runs already stored instead of re-running them")
    p.add_argument("--summary", action="store_true", help="only recompute the grid and summary from stored runs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.summary:
        summarise()
        return
    corpus = data()
    if args.lr is not None or args.seed is not None:
        if args.optimizer is None or args.lr is None or args.seed is None:
            p.error("one run needs --optimizer, --lr and --seed together")
        ensure(args.optimizer, args.lr, args.seed, corpus, skip_stored=False)
        summarise()
        return
    for optimizer in [args.optimizer] if args.optimizer else list(OPTIMIZERS):
        lr = tune(optimizer, corpus, args.skip_stored)
        print(f"{optimizer}: chosen lr {lr:g}", flush=True)
        for seed in SEEDS[1:]:
            ensure(optimizer, lr, seed, corpus, args.skip_stored)
        summarise()


if __name__ == "__main__":
    sys.exit(main())
