"""The induction-head runs behind chapter 14, stored in src/groundup/results/chapter14.json.

    OMP_NUM_THREADS=1 python tools/ch14_results.py              # seeds 0, 1, 2 (about a minute each)
    OMP_NUM_THREADS=1 python tools/ch14_results.py --seed 1     # one seed
    python tools/ch14_results.py --windows                      # only re-read the windows off the stored curves

Each seed trains the two-layer attention-only transformer of :mod:`groundup.induction`'s measured recipe
(``MODEL``: 2 layers x 4 heads, d_model 64, vocabulary 64, context 32, RoPE, untied; ``TRAINING``: batch 32,
learning rate 3e-3, 20 warm-up steps, no weight decay, 2000 steps) with :func:`groundup.training.train` on
``batches=induction_batches``, on one CPU thread. ``torch.manual_seed(seed)`` draws the initial weights and
``TrainConfig.seed = seed`` the training batches.

**The curve.** Every ``RECORD_EVERY`` = 25 steps (and at step 0, before training) the *in-context loss*
(:func:`groundup.induction.in_context_loss`: the loss on the predictable tokens of the repeated half) is measured
on a fixed held-out batch, :func:`held_out`: ``repeated_random_tokens(256, context_length // 2, vocab_size)`` drawn
by a generator seeded with ``HELD_OUT_SEED``, the same batch for every seed. ``train``'s own evaluation (4 fixed
batches of its training distribution, :func:`~groundup.induction.random_repeats`) is stored beside it.

**The phase change**, read off the stored (rounded) curve ``L(s)`` at the recorded steps ``s`` of a run of
``T`` steps (:func:`phase_change`):

* ``plateau``: the median of ``L(s)`` over the recorded steps with ``0.25 T <= s <= 0.35 T`` (steps 500 .. 700
  of 2000, where the stored curves are flat to within their noise of +-0.2; the median, because of that noise);
* ``final``: ``L(T)``, the last recorded value; ``drop = plateau - final``;
* ``half_step``: the first recorded step ``s > 0.35 T`` with ``L(s) < plateau / 2``, the middle of the fall;
* ``start_step``: the *last* recorded step ``s < half_step`` with ``L(s) >= final + 0.9 drop`` (the loss still
  within 10 % of the drop of the plateau): the drop begins after it, so noise on the plateau that dips below
  that level earlier, or a rebound to it, does not move the start;
* ``end_step``: the first recorded step ``s > 0.35 T`` with ``L(s) <= final + 0.1 drop`` (90 % of the drop
  done); ``width = end_step - start_step``.

A step the curve never reaches is None (as is everything when no step lies in the plateau window or the drop is
not positive). The resolution is ``RECORD_EVERY`` steps.

**At the end**, on the held-out batch: every head's previous-token and induction scores
(:func:`groundup.interpretability.previous_token_scores`, :func:`~groundup.interpretability.induction_scores`,
lists ``[layer][head]``), its copying score (:func:`~groundup.interpretability.copying_scores`), the
K-composition scores between the layer-1 heads (rows) and the layer-2 heads (columns) of the trained model and,
as the baseline the composition docstring asks for, of the same model at initialisation; and the in-context loss
with each head ablated alone, zero-ablated and mean-ablated, the means per position
(:func:`~groundup.interpretability.mean_head_outputs` with ``per_position=True``) over a second batch of
repeated sequences (generator seed ``MEAN_SEED``); and with all heads of a layer zero-ablated at once. Layers
and heads count from 0, as in the package.

Each entry records the command that made it and its wall time (not reproducible; everything else is, on one
thread with the same arithmetic). Running a command again replaces its entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from results_file import add_entry

from groundup.induction import AttentionOnlyConfig, in_context_loss, induction_batches, repeated_random_tokens
from groundup.interpretability import (
    ablate_heads,
    attention_patterns,
    composition_scores,
    copying_scores,
    induction_scores,
    mean_head_outputs,
    previous_token_scores,
)
from groundup.models import GPT
from groundup.training import TrainConfig, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter14.json"
MODEL = dict(vocab_size=64, context_length=32, d_model=64, n_layers=2, n_heads=4, positional="rope",
             tie_weights=False)
TRAINING = dict(batch_size=32, max_steps=2000, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, eval_batches=4)
RECORD_EVERY = 25
HELD_OUT_SEED, MEAN_SEED = 1400, 1401
N_HELD_OUT, N_MEAN = 256, 256
PLATEAU_WINDOW = (0.25, 0.35)  # fractions of the run's steps
DIGITS = 5


def held_out(vocab_size: int, context_length: int, n_seq: int = N_HELD_OUT, seed: int = HELD_OUT_SEED):
    """The fixed batch of repeated random sequences the in-context loss is measured on."""
    return repeated_random_tokens(n_seq, context_length // 2, vocab_size, torch.Generator().manual_seed(seed))


def phase_change(steps: list[int], losses: list[float], max_steps: int) -> dict:
    """The phase-change window of a curve by the module docstring's rule."""
    lo, hi = PLATEAU_WINDOW[0] * max_steps, PLATEAU_WINDOW[1] * max_steps
    window = [loss for s, loss in zip(steps, losses) if lo <= s <= hi]
    final = losses[-1]
    empty = {"plateau": None, "final": final, "half_step": None, "start_step": None, "end_step": None,
             "width": None}
    if not window:
        return empty
    plateau = statistics.median(window)
    drop = plateau - final
    if drop <= 0:
        return {**empty, "plateau": plateau}
    after = [(s, loss) for s, loss in zip(steps, losses) if s > hi]

    def first(threshold, strict=False):
        return next((s for s, loss in after if (loss < threshold if strict else loss <= threshold)), None)

    half, end = first(plateau / 2, strict=True), first(final + 0.1 * drop)
    start = None
    if half is not None:
        start = max((s for s, loss in zip(steps, losses) if s < half and loss >= final + 0.9 * drop), default=None)
    return {"plateau": plateau, "final": final, "half_step": half, "start_step": start,
            "end_step": end, "width": None if start is None or end is None else end - start}


def recompute_windows(path: Path = OUT) -> dict:
    """Apply :func:`phase_change` again to every stored curve (no training) and store the windows; returns them
    by key. For a change of the rule: the curves are what the runs measured, the windows only read them."""

    found = {}
    for key, entry in json.loads(Path(path).read_text(encoding="utf-8"))["runs"].items():
        curve = entry["curve"]
        entry["phase_change"] = phase_change(curve["step"], curve["in_context_loss"], entry["training"]["max_steps"])
        add_entry(path, key, entry)
        found[key] = entry["phase_change"]
    return found


def _rounded(t: torch.Tensor):
    return [[round(float(x), DIGITS) for x in row] for row in t.reshape(t.shape[0], -1)]


def scores(model: GPT, tokens: torch.Tensor) -> dict:
    """Per-head scores on ``tokens`` (lists [layer][head])."""
    patterns = attention_patterns(model, tokens)
    return {"previous_token": _rounded(torch.stack([previous_token_scores(p) for p in patterns])),
            "induction": _rounded(torch.stack([induction_scores(p) for p in patterns])),
            "copying": _rounded(torch.stack([copying_scores(model, layer) for layer in range(len(patterns))]))}


def ablations(model: GPT, tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """The in-context loss on ``tokens`` with each head ablated alone (lists [layer][head])."""
    means = mean_head_outputs(model, reference, per_position=True)
    c = model.config
    found = {"none": round(in_context_loss(model, tokens), DIGITS)}
    for mode in ("zero", "mean"):
        table = []
        for layer in range(c.n_layers):
            row = []
            for head in range(c.n_heads):
                with ablate_heads(model, [(layer, head)], mode=mode, means=means if mode == "mean" else None):
                    row.append(round(in_context_loss(model, tokens), DIGITS))
            table.append(row)
        found[mode] = table
    found["zero_layer"] = []
    for layer in range(c.n_layers):
        with ablate_heads(model, [(layer, head) for head in range(c.n_heads)]):
            found["zero_layer"].append(round(in_context_loss(model, tokens), DIGITS))
    return found


def run_seed(seed: int, *, model: dict | None = None, training: dict | None = None,
             record_every: int = RECORD_EVERY) -> tuple[dict, GPT]:
    """Train one seed and measure it: returns ``(entry, trained model)``; ``model`` / ``training`` override
    ``MODEL`` / ``TRAINING`` (for a quick check)."""
    model_kwargs, train_kwargs = {**MODEL, **(model or {})}, {**TRAINING, **(training or {})}
    tick = time.perf_counter()
    torch.manual_seed(seed)
    net = GPT(AttentionOnlyConfig(**model_kwargs))
    tokens = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"])
    reference = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"], N_MEAN, MEAN_SEED)
    at_init = composition_scores(net, 0, 1, kind="k")
    steps, losses = [0], [round(in_context_loss(net, tokens), DIGITS)]

    def record(step, m):
        if step % record_every == 0 and step != steps[-1]:
            steps.append(step)
            losses.append(round(in_context_loss(m, tokens), DIGITS))

    config = TrainConfig(**train_kwargs, eval_interval=record_every, seed=seed, device="cpu", progress=False)
    history = train(net, model_kwargs["vocab_size"], model_kwargs["vocab_size"], config, callback=record,
                    batches=induction_batches)
    if steps[-1] != config.max_steps:  # a run whose length is not a multiple of record_every
        steps.append(config.max_steps)
        losses.append(round(in_context_loss(net, tokens), DIGITS))
    net.eval()
    entry = {
        "seed": seed, "model": model_kwargs,
        "training": {k: v for k, v in dataclasses.asdict(config).items()
                     if k in train_kwargs or k in ("eval_interval", "seed", "grad_clip", "optimizer")},
        "held_out": {"n_seq": N_HELD_OUT, "half_len": model_kwargs["context_length"] // 2, "seed": HELD_OUT_SEED},
        "curve": {"step": steps, "in_context_loss": losses},
        "train_eval": {"step": history.eval_step, "val_loss": [round(v, DIGITS) for v in history.val_loss]},
        "phase_change": phase_change(steps, losses, config.max_steps),
        "scores": scores(net, tokens),
        "k_composition": _rounded(composition_scores(net, 0, 1, kind="k")),
        "k_composition_at_init": _rounded(at_init),
        "ablation": {"means": {"n_seq": N_MEAN, "seed": MEAN_SEED, "per_position": True},
                     **ablations(net, tokens, reference)},
        "threads": torch.get_num_threads(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
    return entry, net


def store(key: str, entry: dict) -> None:
    """Add one entry to the JSON file (several commands may run at once: see tools/results_file.py)."""
    add_entry(OUT, key, entry, header={
        "about": ("Induction-head runs for chapter 14 (one CPU thread each); see tools/ch14_results.py's docstring "
                  "for what is measured and the phase-change rule. Each entry says which command made it.")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, action="append", help="a seed (repeatable; default: 0, 1, 2)")
    p.add_argument("--windows", action="store_true",
                   help="only recompute the stored runs' phase-change windows from their stored curves")
    args = p.parse_args(argv)
    if args.windows:
        for key, pc in recompute_windows().items():
            print(f"{key}: {pc}")
        return
    for seed in args.seed or [0, 1, 2]:
        if seed < 0:
            p.error(f"--seed must be a non-negative integer, got {seed}")
    torch.set_num_threads(1)
    for seed in args.seed or [0, 1, 2]:
        entry, _ = run_seed(seed)
        entry = {"command": f"OMP_NUM_THREADS=1 python tools/ch14_results.py --seed {seed}", **entry}
        store(f"seed{seed}", entry)
        pc, s = entry["phase_change"], entry["scores"]
        print(f"seed {seed}: {entry['wall_seconds']} s, phase change {pc}, prev-token {s['previous_token']}, "
              f"induction {s['induction']}, ablation {entry['ablation']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
