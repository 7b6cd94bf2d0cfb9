"""Chapter 7's runs on the chapter's own model: its seeds, its long run, the optimizer study and the optimizers' step
times, stored in src/groundup/results/chapter07.json under "chapter_runs", one key per run.

    python tools/ch07_chapter_runs.py --entry step-times                 # first, on a quiet machine
    python tools/ch07_chapter_runs.py --entry step-times --fast-kernels  # the same on the machine's fastest kernels
    python tools/ch07_chapter_runs.py --entry seeds --seed S             # S = 0, 1, 2: the chapter's run
    python tools/ch07_chapter_runs.py --entry cli                        # groundup train's seed 0, checked
    python tools/ch07_chapter_runs.py --entry long-run                   # 8000 steps, cosine over all 8000
    python tools/ch07_chapter_runs.py --entry tune --optimizer O [--lr LR]   # short runs: the grid, or one rate
    python tools/ch07_chapter_runs.py --entry optimizers --optimizer O --seed S   # 2000 steps at the chosen rate
    (O = muon: add --fast-kernels, see below)
    python tools/ch07_chapter_runs.py --entry no-clip                    # SGD at its chosen rate, no clipping
    python tools/ch07_chapter_runs.py --entry summary                    # grids, means, equal time (no training)

Every command runs under the notebooks' arithmetic (``tools/results_file.on_notebook_arithmetic``: MKL's
reproducible code path, PyTorch's plain x86-64 kernels, oneDNN, glibc's libm and NumPy capped, as the checked
notebooks run) on one CPU thread, so its numbers are those chapter 7's page computes; ``--fast-kernels`` leaves
the machine's own kernels in force instead (stored entries say which: ``kernels`` and ``machine``). Muon's runs
use it: under the notebooks' arithmetic its Newton-Schulz iteration multiplies bfloat16 matrices without the CPU's
vector units (MKL and oneDNN are capped below them), so a Muon step costs about 6.5 AdamW steps there
(``step_times``) against 1.3 on the fast kernels (``step_times_fast``), and its 3 seeds x 2000 steps would take
about 100 minutes of one core instead of about 10. Its losses are then not bit for bit those the notebooks'
arithmetic would give (the rounding differs from the first step and the runs drift apart as runs on two CPUs do;
not measured here), and they reproduce exactly only on a CPU with this one's kernels.
The model is chapter 7's
(``CHAPTER7_MODEL``: 4 layers, d_model 128, 4 heads, context 64, RoPE, 0.80 M parameters) on the 42-work
Gutenberg Shakespeare corpus (``char_corpus("shakespeare")``: the first 90 % for training), built after
``torch.manual_seed(seed)`` and trained with ``groundup.training.train`` and ``TrainConfig(**CHAPTER7_TRAINING)``
(batch 12 x 64 characters, 2000 steps, warm-up 100, cosine to a tenth of the peak, clipping at norm 1, evaluation
every 250 steps on 20 batches of the validation text) with only the named settings changed. Every run stores its
validation loss on those 20 batches before training and at every evaluation, the loss on the whole validation text
at the end (``evaluate(model, val_ids, batch_size=64)``, as the notebook prints it), its gradient norms before
clipping summarised per evaluation interval (train's ``History.grad_norm``: the fraction of steps above the clip
threshold, and the median), a SHA-256 of its weights at every evaluation, its training seconds (the machine was
shared: a timing only in "step_times"), the command that reproduces it (``command``) and the command line of the
process that ran it (``made_by``).

Keys of the "chapter_runs" section:

- ``seeds/seed0``, ``seeds/seed1``, ``seeds/seed2``: the chapter's run exactly as the notebook trains it, seeds 0-2
  (the seed sets the initial weights and the batch order). Seed 0 is the notebook's run: its entry compares its
  weights and losses with the chapter 7 model cached under the same arithmetic (``load_chapter7_run``).
- ``seeds/cli``: the same run made by ``groundup train`` (the command stored), its weights and final loss compared
  with seed 0's.
- ``long_run``: the same recipe for ``LONG_STEPS`` steps (the cosine over all of them), seed 0, evaluated every
  ``LONG_EVAL_INTERVAL`` steps on 20 batches.
- ``tune/O/lrX``: optimizer O for ``TUNE_STEPS`` steps (warm-up ``TUNE_WARMUP``, cosine over the short run) at peak
  rate X, seed 0. Each optimizer's grid is ``GRIDS`` (about 3x apart), extended by one value beyond an edge while
  the best rate is at that edge (up to ``MAX_EXTENSIONS`` times); the chosen rate has the lowest final loss on the
  whole validation text. AdamW is not tuned here: it keeps the chapter's 3e-3 (tuned for this model and corpus in
  the chapter's recipe search, and by the range tests of tools/ch07_extras.py).
- ``optimizers/O/seedS``: optimizer O at its chosen rate for the chapter's 2000 steps, seeds 0-2. AdamW's are the
  ``seeds/seedS`` runs (not run again).
- ``optimizers/sgd_no_clip/seed0``: SGD at its chosen rate without gradient clipping (``grad_clip=None``);
  ``tune/sgd_no_clip/lrX``: short runs of SGD without clipping at lower rates (``--entry tune --optimizer sgd --lr X
  --no-clip``), beside the clipped ``tune/sgd/lrX``, for clipping's effect where SGD without it stays finite.
- ``step_times`` (``step_times_fast``): seconds per training step of each optimizer, the optimizers timed in turn
  (``ROUNDS`` rounds of ``ROUND_STEPS`` steps each after ``WARMUP_STEPS``) in one process on one thread, under the
  notebooks' arithmetic (on the machine's fastest kernels): the step is train's (a batch drawn, forward, backward,
  clipping, the update and the schedule), without its evaluations.
- ``summary``: each grid and its chosen rate, the three seeds' final losses (mean, sd) per optimizer, clipping under
  SGD (with and without), the long run's final loss, and the optimizers at equal time by either timing
  (``equal_time``, ``equal_time_fast``: see :func:`equal_time`).

The optimizers (``OPTIMIZERS``) differ only in the update: ``sgd`` is eq. (7.3) (``optimizer="sgd"``, ``beta1=0``),
``sgd_momentum`` heavy-ball momentum 0.9, both without weight decay (``torch.optim.SGD`` adds λθ to the gradient: at
SGD's rates λ = 0.1 would shrink the matrices by a percent or more per step); ``adamw`` is the chapter's; ``muon``
is Muon on the blocks' matrices with AdamW on the rest (``optimizer="muon"``, the package's weight decay 0.1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import NOTEBOOK_ARITHMETIC, add_entry, machine, on_notebook_arithmetic

from groundup.char_data import char_corpus
from groundup.models import GPT, GPTConfig
from groundup.training import (
    CHAPTER7_MODEL,
    CHAPTER7_TRAINING,
    TrainConfig,
    TrainingDiverged,
    evaluate,
    load_chapter7_run,
    load_checkpoint,
    train,
)

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter07.json"
SECTION = "chapter_runs"
TOOL = "python tools/ch07_chapter_runs.py"
CORPUS = "shakespeare"
MODEL = dict(CHAPTER7_MODEL)
TRAINING = dict(CHAPTER7_TRAINING)
SEEDS = (0, 1, 2)
FULL_BATCH = 64  # the whole validation text in batches of 64 windows, as the notebook evaluates it
LONG_STEPS, LONG_EVAL_INTERVAL = 8000, 500
TUNE_STEPS, TUNE_WARMUP, TUNE_EVAL_INTERVAL = 400, 20, 100
OPTIMIZERS = {  # name: (label, TrainConfig settings)
    "sgd": ("SGD (7.3)", dict(optimizer="sgd", beta1=0.0, weight_decay=0.0)),
    "sgd_momentum": ("SGD + momentum 0.9", dict(optimizer="sgd", beta1=0.9, weight_decay=0.0)),
    "adamw": ("AdamW (the chapter's)", dict(optimizer="adamw")),
    "muon": ("Muon + AdamW", dict(optimizer="muon")),
}
GRIDS = {
    "sgd": [0.3, 1.0, 3.0],
    "sgd_momentum": [0.03, 0.1, 0.3],
    "muon": [3e-3, 1e-2, 3e-2],
}  # AdamW is not tuned: it keeps the chapter's rate
ADAMW_LR = TRAINING["learning_rate"]
MAX_EXTENSIONS = 2
ROUNDS, ROUND_STEPS, WARMUP_STEPS = 5, 30, 10


# --- one run --------------------------------------------------------------------------------------------------------


def data():
    """(tokenizer, train_ids, val_ids) of the chapter's corpus, as chapter 7 builds them."""
    return char_corpus(CORPUS)


def config(optimizer: str = "adamw", lr: float = ADAMW_LR, seed: int = 0, *, steps: int = TRAINING["max_steps"],
           **changes) -> TrainConfig:
    """Chapter 7's TrainConfig with ``optimizer``'s settings, peak rate ``lr``, ``seed``, ``steps`` and ``changes``."""
    settings = {**TRAINING, **OPTIMIZERS[optimizer][1], "learning_rate": lr, "seed": seed, "max_steps": steps,
                **changes}
    return TrainConfig(**settings, progress=False)


def new_model(vocab_size: int, seed: int, shape: dict = MODEL) -> GPT:
    """Chapter 7's GPT as the notebook builds it: ``torch.manual_seed(seed)``, then ``GPT(GPTConfig(...))``."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, **shape))


def weights_sha256(model) -> str:
    """A fingerprint of the weights: SHA-256 of every tensor's bytes, in state-dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def grad_norm_summary(history, clip: float | None, interval: int) -> dict:
    """The gradient norms before clipping (train's History.grad_norm), per ``interval`` steps: the fraction of steps
    whose norm exceeded the clip threshold (1 where None: what clipping at 1 would have done), and the median."""
    threshold = 1.0 if clip is None else clip
    norms = history.grad_norm
    windows = [norms[i:i + interval] for i in range(0, len(norms), interval)]
    return {"threshold": threshold, "clipped": clip is not None,
            "fraction_above": round(sum(g > threshold for g in norms) / len(norms), 4),
            "window_end_step": [min(i + interval, len(norms)) for i in range(0, len(norms), interval)],
            "window_fraction_above": [round(sum(g > threshold for g in w) / len(w), 4) for w in windows],
            "window_median": [round(statistics.median(w), 4) for w in windows],
            "first_10": [round(g, 4) for g in norms[:10]], "max": round(max(norms), 4)}


def run(cfg: TrainConfig, corpus, *, shape: dict = MODEL) -> tuple[dict, GPT]:
    """One training run as chapter 7 makes it: (its entry, the trained model). A diverged run gets ``diverged_at``
    and no final loss (None)."""
    tokenizer, train_ids, val_ids = corpus
    model = new_model(tokenizer.vocab_size, cfg.seed, shape)
    first = evaluate(model, val_ids, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)  # train's batches
    hashes = {}
    entry = {"settings": {k: v for k, v in vars(cfg).items() if k not in ("progress", "out_dir", "resume", "device")},
             "diverged_at": None}
    start = time.perf_counter()
    try:
        history = train(model, train_ids, val_ids, cfg, callback=lambda step, m: hashes.__setitem__(
            step, weights_sha256(m)))
    except TrainingDiverged as err:
        return {**entry, "diverged_at": str(err), "eval_step": [0], "val_loss": [round(first, 5)],
                "full_val_loss": None, "seconds": round(time.perf_counter() - start, 1)}, model
    seconds = time.perf_counter() - start
    full = evaluate(model, val_ids, batch_size=FULL_BATCH)
    return {**entry, "eval_step": [0, *history.eval_step], "tokens": [0, *history.tokens],
            "val_loss": [round(v, 5) for v in (first, *history.val_loss)],
            "val_loss_exact": [first, *history.val_loss], "full_val_loss": round(full, 5), "full_val_loss_exact": full,
            "train_loss_last_50": round(statistics.fmean(history.train_loss[-50:]), 5),
            "grad_norm": grad_norm_summary(history, cfg.grad_clip, cfg.eval_interval),
            "weights_sha256": [hashes[s] for s in history.eval_step], "seconds": round(seconds, 1)}, model


def fast_kernels() -> bool:
    """True when this process runs on the machine's fastest kernels (``--fast-kernels``: none of the notebooks'
    arithmetic variables set), False under the notebooks' arithmetic."""
    return not any(k in os.environ for k in NOTEBOOK_ARITHMETIC)


def flag() -> str:
    """The flag that reproduces this process's kernels in a stored command."""
    return " --fast-kernels" if fast_kernels() else ""


def store(key: str, entry: dict, command: str) -> None:
    kernels = "the machine's fastest (no arithmetic caps)" if fast_kernels() else "the notebooks' arithmetic"
    entry = {**entry, "kernels": kernels, "command": command, "made_by": shlex.join(["python", *sys.argv]),
             "machine": machine()}
    add_entry(OUT, key, entry, section=SECTION)
    print(f"stored {key}: final loss {entry.get('full_val_loss')} (whole validation text), "
          f"{entry.get('seconds')} s", flush=True)


def stored() -> dict:
    return json.loads(OUT.read_text(encoding="utf-8")).get(SECTION, {}) if OUT.exists() else {}


# --- the entries ----------------------------------------------------------------------------------------------------


def seed_run(seed: int, corpus) -> None:
    """The chapter's run with ``seed``; seed 0 checked against the cached chapter 7 model of this arithmetic."""
    entry, model = run(config(seed=seed), corpus)
    entry.update(optimizer="adamw", label=OPTIMIZERS["adamw"][0], lr=ADAMW_LR, seed=seed)
    if seed == 0:
        entry["notebook_check"] = notebook_check(model, entry, corpus)
    store(f"seeds/seed{seed}", entry, f"{TOOL} --entry seeds --seed {seed}")
    if seed == 0 and entry["notebook_check"]["cached"] and not entry["notebook_check"]["equal_weights"]:
        raise SystemExit("seed 0 does not reproduce the cached chapter 7 model: see notebook_check")


def notebook_check(model, entry: dict, corpus) -> dict:
    """Seed 0 against the chapter 7 model that chapter 7 (or chapter7_model) cached under this arithmetic."""
    cached = load_chapter7_run()
    if cached is None:
        return {"cached": False, "note": "no chapter 7 model is cached under this arithmetic: nothing to compare"}
    a, b = model.state_dict(), cached.model.state_dict()
    full = evaluate(cached.model, corpus[2], batch_size=FULL_BATCH)
    return {"cached": True, "equal_weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "cached_full_val_loss_exact": full, "equal_full_val_loss": full == entry["full_val_loss_exact"],
            "equal_curve": list(cached.history.val_loss) == entry["val_loss_exact"][1:],
            "notebook_prints": f"{full:.3f}"}


def cli_args(seed: int = 0, steps: int = TRAINING["max_steps"], eval_interval: int = TRAINING["eval_interval"],
             out: str = "runs/ch07-seed0") -> list[str]:
    """``groundup train``'s flags for the chapter's run (its recipe's defaults replaced by chapter 7's settings)."""
    t, m = TRAINING, MODEL
    return ["train", "--corpus", CORPUS, "--context", str(m["context_length"]), "--d-model", str(m["d_model"]),
            "--layers", str(m["n_layers"]), "--heads", str(m["n_heads"]), "--positional", m["positional"],
            "--dropout", "0", "--batch-size", str(t["batch_size"]), "--lr", f"{t['learning_rate']:g}",
            "--warmup", str(t["warmup_steps"]), "--weight-decay", "0.1", "--grad-clip", "1",
            "--optimizer", "adamw", "--eval-interval", str(eval_interval), "--eval-batches", str(t["eval_batches"]),
            "--threads", "1", "--device", "cpu", "--max-steps", str(steps), "--seed", str(seed), "--no-progress",
            "--out", out]


def cli_run(corpus) -> None:
    """Seed 0 made by ``groundup train`` (in a subprocess, same arithmetic), compared with the stored seed 0."""
    seed0 = stored().get("seeds/seed0")
    with tempfile.TemporaryDirectory() as tmp:
        args = cli_args(out=str(Path(tmp) / "run"))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "groundup", *args], check=True)
        seconds = time.perf_counter() - start
        model, ckpt = load_checkpoint(Path(tmp) / "run")
    full = evaluate(model, corpus[2], batch_size=FULL_BATCH)
    cached = load_chapter7_run()
    entry = {"cli": "groundup " + shlex.join(cli_args()), "eval_step": ckpt["history"]["eval_step"],
             "val_loss": [round(v, 5) for v in ckpt["history"]["val_loss"]], "full_val_loss": round(full, 5),
             "full_val_loss_exact": full, "weights_sha256": weights_sha256(model), "seconds": round(seconds, 1),
             "equal_to_seed0": None if seed0 is None else {
                 "full_val_loss": full == seed0["full_val_loss_exact"],
                 "curve": ckpt["history"]["val_loss"] == seed0["val_loss_exact"][1:],
                 "weights_sha256": weights_sha256(model) == seed0["weights_sha256"][-1]},
             "equal_to_cached_chapter7_model": None if cached is None else all(
                 torch.equal(v, cached.model.state_dict()[k]) for k, v in model.state_dict().items()),
             "note": "groundup train's defaults are the command line's recipe (Muon, a larger model); every setting "
                     "of chapter 7's run is given as a flag. --device cpu and --threads 1 as the chapter trains"}
    store("seeds/cli", entry, f"{TOOL} --entry cli")


def long_run(corpus) -> None:
    cfg = config(steps=LONG_STEPS, eval_interval=LONG_EVAL_INTERVAL)
    entry, _ = run(cfg, corpus)
    entry.update(optimizer="adamw", lr=ADAMW_LR, seed=0, steps=LONG_STEPS,
                 cli_equivalent="groundup " + shlex.join(cli_args(steps=LONG_STEPS, eval_interval=LONG_EVAL_INTERVAL,
                                                                  out="runs/ch07-long")))
    store("long_run", entry, f"{TOOL} --entry long-run")


def tune_key(optimizer: str, lr: float) -> str:
    return f"tune/{optimizer}/lr{lr:g}"


def tune_one(optimizer: str, lr: float, corpus, *, clip: bool = True) -> float:
    """One short run of the tuning (with ``clip=False``: without clipping, stored as ``tune/O_no_clip/lrX``)."""
    entry, _ = run(config(optimizer, lr, 0, steps=TUNE_STEPS, warmup_steps=TUNE_WARMUP,
                          eval_interval=TUNE_EVAL_INTERVAL, **({} if clip else {"grad_clip": None})), corpus)
    entry.update(optimizer=optimizer, label=OPTIMIZERS[optimizer][0] + ("" if clip else ", no clipping"), lr=lr,
                 seed=0)
    store(tune_key(optimizer if clip else f"{optimizer}_no_clip", lr), entry,
          f"{TOOL} --entry tune --optimizer {optimizer} --lr {lr:g}{'' if clip else ' --no-clip'}{flag()}")
    return final(entry)


def final(entry: dict) -> float:
    """A run's final loss on the whole validation text; a diverged run counts as infinite."""
    return math.inf if entry["full_val_loss"] is None else entry["full_val_loss"]


def next_value(grid: list[float], lower: bool) -> float:
    """One more grid value beyond the edge, at the ratio of the two values at that edge."""
    a, b = (grid[0], grid[1]) if lower else (grid[-1], grid[-2])
    return float(f"{a * a / b:.3g}")


def tune(optimizer: str, corpus) -> float:
    """The grid (runs already stored are kept), extended while its best rate is at an edge; the chosen rate."""
    runs = stored()
    losses = {lr: (final(runs[tune_key(optimizer, lr)]) if tune_key(optimizer, lr) in runs
                   else tune_one(optimizer, lr, corpus)) for lr in GRIDS[optimizer]}
    for _ in range(MAX_EXTENSIONS):
        grid = sorted(losses)
        best = min(grid, key=losses.get)
        if best not in (grid[0], grid[-1]):
            break
        lr = next_value(grid, lower=best == grid[0])
        losses[lr] = final(stored().get(tune_key(optimizer, lr))) if tune_key(optimizer, lr) in stored() \
            else tune_one(optimizer, lr, corpus)
    return min(sorted(losses), key=losses.get)


def grid_of(optimizer: str, runs: dict) -> dict | None:
    """The stored grid of ``optimizer``: its rates, final losses, the chosen rate and whether it is inside."""
    lrs = sorted(r["lr"] for k, r in runs.items() if k.startswith(f"tune/{optimizer}/"))
    if optimizer not in GRIDS or not set(GRIDS[optimizer]) <= set(lrs):
        return None
    finals = [runs[tune_key(optimizer, lr)]["full_val_loss"] for lr in lrs]
    best = min(lrs, key=lambda lr: final(runs[tune_key(optimizer, lr)]))
    chosen = ADAMW_LR if optimizer == "adamw" else best
    return {"lr": lrs, "full_val_loss": finals, "best": best, "chosen": chosen, "inside": lrs[0] < best < lrs[-1]}


def chosen_lr(optimizer: str) -> float:
    if optimizer == "adamw":
        return ADAMW_LR
    grid = grid_of(optimizer, stored())
    if grid is None:
        raise SystemExit(f"{optimizer} is not tuned yet: run {TOOL} --entry tune --optimizer {optimizer}")
    return grid["chosen"]


def optimizer_run(optimizer: str, seed: int, corpus) -> None:
    if optimizer == "adamw":
        raise SystemExit(f"AdamW's runs are the chapter's seeds: {TOOL} --entry seeds --seed {seed}")
    lr = chosen_lr(optimizer)
    entry, _ = run(config(optimizer, lr, seed), corpus)
    entry.update(optimizer=optimizer, label=OPTIMIZERS[optimizer][0], lr=lr, seed=seed)
    store(f"optimizers/{optimizer}/seed{seed}", entry, f"{TOOL} --entry optimizers --optimizer {optimizer} "
                                                       f"--seed {seed}{flag()}")


def no_clip_run(corpus) -> None:
    lr = chosen_lr("sgd")
    entry, _ = run(config("sgd", lr, 0, grad_clip=None), corpus)
    entry.update(optimizer="sgd", label="SGD (7.3), no clipping", lr=lr, seed=0)
    store("optimizers/sgd_no_clip/seed0", entry, f"{TOOL} --entry no-clip{flag()}")


# --- step times -------------------------------------------------------------------------------------------------


def step_times(corpus, fast: bool) -> None:
    """Seconds per training step of each optimizer, timed in turn, ROUNDS rounds of ROUND_STEPS steps."""
    from groundup.training import _backward, _clip_gradients, _make_optimizer, _next_batch, _update, lr_at

    tokenizer, train_ids, _ = corpus
    device = torch.device("cpu")
    sides = {}
    for name in OPTIMIZERS:
        cfg = config(name, chosen_or_grid_middle(name))
        model = new_model(tokenizer.vocab_size, 0).train()
        optimizer = _make_optimizer(model, cfg, device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, c=cfg: lr_at(s, c) / c.learning_rate)
        generator = torch.Generator().manual_seed(0)

        def steps(n, model=model, optimizer=optimizer, scheduler=scheduler, generator=generator, cfg=cfg):
            for _ in range(n):
                inputs, targets = _next_batch(train_ids, None, cfg.batch_size, MODEL["context_length"], generator)
                loss = _backward(model, inputs, targets, device, optimizer)
                loss.item(), _clip_gradients(model, cfg.grad_clip)
                _update(optimizer, scheduler)
        steps(WARMUP_STEPS)
        sides[name] = steps
    times = {name: [] for name in sides}
    for _ in range(ROUNDS):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn(ROUND_STEPS)
            times[name].append((time.perf_counter() - start) / ROUND_STEPS)
    medians = {k: statistics.median(v) for k, v in times.items()}
    entry = {"unit": "seconds per training step (batch 12 x 64; a batch drawn, forward, backward, clipping, update, "
                     "schedule; no evaluation)",
                      "rounds": ROUNDS, "steps_per_round": ROUND_STEPS, "warmup_steps": WARMUP_STEPS,
             "per_round": {k: [round(t, 6) for t in v] for k, v in times.items()},
             "median": {k: round(t, 6) for k, t in medians.items()},
             "relative_to_adamw": {k: round(t / medians["adamw"], 3) for k, t in medians.items()},
             "lr": {k: chosen_or_grid_middle(k) for k in OPTIMIZERS},
             "note": "the learning rate does not change the work of a step; it is the chosen rate where one was "
                     "chosen when this ran, else the middle of the grid"}
    for k, t in medians.items():
        print(f"{k}: {t * 1000:.1f} ms per step ({entry['relative_to_adamw'][k]} x AdamW)", flush=True)
    store("step_times_fast" if fast else "step_times", entry,
          f"{TOOL} --entry step-times" + (" --fast-kernels" if fast else ""))


def chosen_or_grid_middle(optimizer: str) -> float:
    if optimizer == "adamw":
        return ADAMW_LR
    grid = grid_of(optimizer, stored())
    return grid["chosen"] if grid else GRIDS[optimizer][1]


# --- the summary ------------------------------------------------------------------------------------------------


def run_of(optimizer: str, seed: int, runs: dict) -> dict | None:
    return runs.get(f"seeds/seed{seed}" if optimizer == "adamw" else f"optimizers/{optimizer}/seed{seed}")


def loss_at_step(entry: dict, step: float) -> float | None:
    """The 20-batch validation loss of a run after ``step`` steps, linear between its evaluations (None past
    its last)."""
    xs, ys = entry["eval_step"], entry["val_loss"]
    if step > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= step <= x1:
            return round(y0 + (y1 - y0) * (step - x0) / (x1 - x0), 5)
    return ys[0]


def equal_time(runs: dict, optimizers: dict, times: dict) -> dict:
    """The optimizers at equal wall-clock time: the fastest one's 2000 steps in seconds (by ``times``' medians),
    and each optimizer's 20-batch validation loss after as many of its own steps as fit in them."""
    median = times["median"]
    budget = min(median[o] for o in optimizers) * TRAINING["max_steps"]
    return {"seconds": round(budget, 1), "kernels": times["kernels"],
            "about": ("the fastest optimizer's 2000 steps in seconds (median step times measured on these kernels); "
                      "each optimizer's 20-batch validation loss after as many of its steps as fit in them (seconds "
                      "/ its median step time), read off its 2000-step curve linearly between evaluations, mean of "
                      "the three seeds. The slower optimizers are read mid-schedule (their cosine was set for 2000 "
                      "steps, not for the shorter budget), which favours the faster ones slightly"),
            "optimizers": {o: {"steps": round(budget / median[o]), "seconds_per_step": median[o],
                               "val_loss_20_batches": round(statistics.mean(
                                   loss_at_step(run_of(o, s, runs), budget / median[o]) for s in SEEDS), 5)}
                           for o in optimizers}}


def summary() -> None:
    """The grids, the chosen rates, the seeds' means, clipping under SGD, the long run and the equal-time table."""
    runs = stored()
    grids = {o: g for o in OPTIMIZERS if (g := grid_of(o, runs))}
    optimizers = {}
    for o, (label, settings) in OPTIMIZERS.items():
        seeds = [run_of(o, s, runs) for s in SEEDS]
        if not all(seeds):
            continue
        finals = [final(r) for r in seeds]
        optimizers[o] = {"label": label, "settings": settings, "lr": seeds[0]["lr"], "seeds": list(SEEDS),
                         "full_val_loss": finals, "mean": round(statistics.mean(finals), 5),
                         "sd": round(statistics.stdev(finals), 5),
                         "clip_fraction_above": [r["grad_norm"]["fraction_above"] for r in seeds],
                         "runs": [f"seeds/seed{s}" if o == "adamw" else f"optimizers/{o}/seed{s}" for s in SEEDS]}
    result = {"grids": grids, "optimizers": optimizers, "tuning": {
        "steps": TUNE_STEPS, "warmup_steps": TUNE_WARMUP, "eval_interval": TUNE_EVAL_INTERVAL, "seed": 0,
        "grids": GRIDS, "max_extensions": MAX_EXTENSIONS, "adamw_lr": ADAMW_LR,
        "rule": "lowest final loss on the whole validation text after the short run; AdamW keeps the chapter's rate"}}
    seed0 = runs.get("seeds/seed0")
    if seed0:
        result["seed0_vs_notebook"] = {"full_val_loss": seed0["full_val_loss"], **seed0["notebook_check"]}
    if "seeds/cli" in runs:
        result["cli"] = {k: runs["seeds/cli"][k] for k in ("cli", "full_val_loss", "equal_to_seed0",
                                                           "equal_to_cached_chapter7_model")}
    if "long_run" in runs:
        result["long_run"] = {"steps": LONG_STEPS, "full_val_loss": runs["long_run"]["full_val_loss"]}
    clipped, unclipped = run_of("sgd", 0, runs), runs.get("optimizers/sgd_no_clip/seed0")
    if clipped and unclipped:
        result["sgd_clipping"] = {
            "lr": clipped["lr"], "with_clipping": final(clipped) if clipped["full_val_loss"] else None,
            "without_clipping": unclipped["full_val_loss"], "diverged_without": unclipped["diverged_at"],
            "fraction_of_steps_clipped": clipped["grad_norm"]["fraction_above"],
            "window_fraction_clipped": clipped["grad_norm"]["window_fraction_above"],
            "window_median_norm_clipped": clipped["grad_norm"]["window_median"],
            "window_median_norm_unclipped": (unclipped.get("grad_norm") or {}).get("window_median"),
            "short_runs": {f"{lr:g}": {"clipped": runs.get(tune_key("sgd", lr), {}).get("full_val_loss"),
                                       "unclipped": r["full_val_loss"], "diverged_unclipped": r["diverged_at"],
                                       "fraction_above_1_unclipped": (r.get("grad_norm") or {}).get("fraction_above"),
                                       "fraction_clipped": runs.get(tune_key("sgd", lr), {}).get(
                                           "grad_norm", {}).get("fraction_above")}
                           for lr, r in sorted((r["lr"], r) for k, r in runs.items()
                                               if k.startswith("tune/sgd_no_clip/"))}}
    for timing in ("step_times", "step_times_fast"):
        if timing in runs and optimizers:
            result[f"equal_time{timing[len('step_times'):]}"] = equal_time(runs, optimizers, runs[timing])
    add_entry(OUT, "about", __doc__.split("\n\n", 1)[0].replace("\n", " ") + " See tools/ch07_chapter_runs.py.",
              section=SECTION)
    add_entry(OUT, "setup", {"corpus": "shakespeare (Gutenberg, 42 works; char_corpus: the last 10 % for validation)",
                             "model": MODEL, "training": TRAINING, "seeds": list(SEEDS),
                             "optimizers": {k: {"label": v[0], **v[1]} for k, v in OPTIMIZERS.items()},
                             "long_run": {"steps": LONG_STEPS, "eval_interval": LONG_EVAL_INTERVAL},
                             "full_val_batch_size": FULL_BATCH, "threads": 1,
                             "arithmetic": "the notebooks' (tools/results_file.NOTEBOOK_ARITHMETIC)"}, section=SECTION)
    add_entry(OUT, "summary", result, section=SECTION)
    print(json.dumps(result, indent=1)[:4000])


ENTRIES = ("step-times", "seeds", "cli", "long-run", "tune", "optimizers", "no-clip", "summary")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES, required=True)
    p.add_argument("--seed", type=int, choices=SEEDS, help="seeds, optimizers: the run's seed")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="tune, optimizers: the optimizer")
    p.add_argument("--lr", type=float, help="tune: one short run at this rate (default: the grid, extended)")
    p.add_argument("--no-clip", action="store_true", help="tune --lr: the short run without gradient clipping")
    p.add_argument("--fast-kernels", action="store_true",
                   help="on the machine's fastest kernels, not the notebooks' arithmetic (step-times; muon's runs)")
    a = p.parse_args(argv)
    if not a.fast_kernels:
        on_notebook_arithmetic()
    elif any(k in os.environ for k in NOTEBOOK_ARITHMETIC):  # the fastest kernels: no caps (read at load time)
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {k: v for k, v in os.environ.items() if k not in NOTEBOOK_ARITHMETIC})
    torch.set_num_threads(1)
    if a.entry == "summary":
        summary()
        return
    corpus = data()
    if a.entry == "step-times":
        step_times(corpus, a.fast_kernels)
    elif a.entry == "seeds":
        if a.seed is None:
            p.error("--entry seeds needs --seed")
        seed_run(a.seed, corpus)
    elif a.entry == "cli":
        cli_run(corpus)
    elif a.entry == "long-run":
        long_run(corpus)
    elif a.entry == "tune":
        if a.optimizer not in GRIDS:
            p.error(f"--entry tune needs --optimizer, one of {', '.join(GRIDS)} (AdamW keeps the chapter's rate)")
        if a.lr is not None:
            tune_one(a.optimizer, a.lr, corpus, clip=not a.no_clip)
        elif a.no_clip:
            p.error("--no-clip makes one short run: give --lr")
        else:
            print(f"{a.optimizer}: chosen lr {tune(a.optimizer, corpus):g}", flush=True)
    elif a.entry == "optimizers":
        if a.optimizer is None or a.seed is None:
            p.error("--entry optimizers needs --optimizer and --seed")
        optimizer_run(a.optimizer, a.seed, corpus)
    elif a.entry == "no-clip":
        no_clip_run(corpus)


if __name__ == "__main__":
    main()
