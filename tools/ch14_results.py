"""The induction-head runs behind chapter 14, stored in src/groundup/results/chapter14.json.

    OMP_NUM_THREADS=1 python tools/ch14_results.py              # seeds 0, 1, 2 (one to two minutes each)
    OMP_NUM_THREADS=1 python tools/ch14_results.py --seed 1     # one seed
    python tools/ch14_results.py --windows                      # only re-read the windows off the stored curves
    OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default \
        python tools/ch14_results.py --entry smollm2-copying    # SmolLM2's copying scores (485 s here)
    ... --entry smollm2-lens                                    # SmolLM2's logit lens on validation text (760 s)
    ... --entry chapter7-lens                                   # chapter 7's, on all its validation text (107 s)

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

* ``plateau``: the median of ``L(s)`` over the recorded steps with ``0.05 T <= s <= 0.10 T`` (steps 100 .. 200
  of 2000: after the first fall from the untrained model's ~4.6 and before the drop, where the stored curves
  decline slowly, every value within 0.3 of the median; the median, because of the evaluation noise);
* ``final``: ``L(T)``, the last recorded value; ``drop = plateau - final``;
* ``half_step``: the first recorded step ``s > 0.10 T`` with ``L(s) < plateau / 2``, the middle of the fall;
* ``start_step``: the *last* recorded step ``s < half_step`` with ``L(s) >= final + 0.9 drop`` (the loss still
  within 10 % of the drop of the plateau): the drop begins after it, so noise on the plateau that dips below
  that level earlier, or a rebound to it, does not move the start;
* ``end_step``: the first recorded step ``s > 0.10 T`` with ``L(s) <= final + 0.1 drop`` (90 % of the drop
  done); ``width = end_step - start_step``.

A step the curve never reaches is None (as is everything when no step lies in the plateau window or the drop is
not positive). The resolution is ``RECORD_EVERY`` steps.

**At the end**, on the held-out batch: every head's previous-token and induction scores
(:func:`groundup.interpretability.previous_token_scores`, :func:`~groundup.interpretability.induction_scores`,
lists ``[layer][head]``), its copying score (:func:`~groundup.interpretability.copying_scores`), the
K-composition scores between the layer-0 heads (rows) and the layer-1 heads (columns) of the trained model and,
as the baseline the composition docstring asks for, of the same model at initialisation; and the in-context loss
with each head ablated alone, zero-ablated and mean-ablated, the means per position
(:func:`~groundup.interpretability.mean_head_outputs` with ``per_position=True``) over a second batch of
repeated sequences (generator seed ``MEAN_SEED``); and with all heads of a layer zero-ablated at once. Layers
and heads count from 0, as in the package.

**The heads forming** (``head_scores``, every ``head_scores_every`` = ``RECORD_EVERY`` steps: at the curve's steps,
step 0 included, in the same callback): on the same held-out batch, every head's previous-token and induction scores
(lists ``[layer][head]`` per step) and the K-composition scores between the layer-0 heads (rows) and the layer-1
heads (columns) (lists ``[h0][h1]`` per step), by :func:`head_scores`. The last step's are the final ``scores`` and
``k_composition``; step 0's are the initialised model's (``k_composition_at_init``). Measuring needs no random
numbers and leaves the model in training mode, so the training (and every other number of the entry) is the same
as without it.

**SmolLM2 and chapter 7's model** (``--entry``, stored in the file's ``measurements`` section under the
entry's name, not in ``runs``):

* ``smollm2-copying``: for every one of SmolLM2's 30 x 9 heads, on ``COPY_TOKENS`` = 1024 token ids drawn
  uniformly without replacement from the 49,152 (``torch.randperm`` with a generator seeded ``COPY_SEED``: the
  same kind of tokens as the repeated-random-token test draws), the ranks of
  :func:`groundup.interpretability.copying_ranks` (rank 0: the token's own logit is the top one of its column of
  ``M^h``), summarised per head as ``copying`` (eq. 14.5: the fraction of rank 0), ``hits`` (that count),
  ``top10`` (the fraction of rank < 10) and ``median_rank``; and the eigenvalue score
  (:func:`~groundup.interpretability.ov_eigenvalue_scores`, on the whole vocabulary). A random circuit gives
  ``copying`` about 1/49,152 and a median rank about 24,576.
* ``smollm2-lens`` / ``chapter7-lens``: the logit lens (:func:`lens_statistics`) on windows of the validation
  text (the last 10 % of the Shakespeare corpus, :func:`groundup.data.train_val_split`): ``LENS_WINDOWS`` = 32
  windows of 129 SmolLM2 tokens spread evenly over it (128 predictions each, 4,096 in all), and for chapter 7's
  model every whole window of 65 characters (its context) of it. Per stream entry ``l = 0 .. n_layers``:
  ``top1`` (the fraction of positions where the lens's argmax is the next token; ``hits``, their number; for
  SmolLM2 also ``window_hits``, the numbers per window), ``prob`` (the mean probability of the next token),
  ``nll`` (its mean negative log-probability, nats) and ``median_rank`` (of the next token among all, 0 = top);
  and ``solved`` (the fraction of positions the model itself gets right) with ``first_stays`` (over those
  positions, the mean first entry from which the lens's argmax is the next token at every later entry).

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

from groundup.data import load_corpus, train_val_split
from groundup.induction import AttentionOnlyConfig, in_context_loss, induction_batches, repeated_random_tokens
from groundup.interpretability import (
    ablate_heads,
    attention_patterns,
    composition_scores,
    copying_ranks,
    copying_scores,
    induction_scores,
    mean_head_outputs,
    ov_eigenvalue_scores,
    previous_token_scores,
    residual_stream,
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
PLATEAU_WINDOW = (0.05, 0.10)  # fractions of the run's steps
DIGITS = 5
COPY_TOKENS, COPY_SEED = 1024, 14
LENS_WINDOWS, LENS_WINDOW_TOKENS = 32, 129  # SmolLM2: 32 windows of 129 tokens, 128 predictions each
ENTRIES = ("smollm2-copying", "smollm2-lens", "chapter7-lens")


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


def head_scores(model: GPT, tokens: torch.Tensor) -> dict:
    """What :func:`run_seed` records every ``RECORD_EVERY`` steps: each head's previous-token and induction scores
    on ``tokens`` (lists [layer][head]) and the K-composition scores of the layer-0 heads (rows) into the layer-1
    heads (columns). In eval mode without gradients, the model's mode restored; no random numbers drawn."""
    patterns = attention_patterns(model, tokens)
    return {"previous_token": _rounded(torch.stack([previous_token_scores(p) for p in patterns])),
            "induction": _rounded(torch.stack([induction_scores(p) for p in patterns])),
            "k_composition": _rounded(composition_scores(model, 0, 1, kind="k"))}


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
             record_every: int = RECORD_EVERY, record_heads: bool = True) -> tuple[dict, GPT]:
    """Train one seed and measure it: returns ``(entry, trained model)``; ``model`` / ``training`` override
    ``MODEL`` / ``TRAINING`` (for a quick check). ``record_heads=False`` leaves out ``head_scores`` (the training
    and the rest of the entry are the same)."""
    model_kwargs, train_kwargs = {**MODEL, **(model or {})}, {**TRAINING, **(training or {})}
    tick = time.perf_counter()
    torch.manual_seed(seed)
    net = GPT(AttentionOnlyConfig(**model_kwargs))
    tokens = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"])
    reference = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"], N_MEAN, MEAN_SEED)
    at_init = composition_scores(net, 0, 1, kind="k")
    steps, losses = [], []
    heads = {"step": [], "previous_token": [], "induction": [], "k_composition": []}

    def measure(step, m):
        steps.append(step)
        losses.append(round(in_context_loss(m, tokens), DIGITS))
        if record_heads:
            heads["step"].append(step)
            for name, table in head_scores(m, tokens).items():
                heads[name].append(table)

    def record(step, m):
        if step % record_every == 0 and step != steps[-1]:
            measure(step, m)

    measure(0, net)

    config = TrainConfig(**train_kwargs, eval_interval=record_every, seed=seed, device="cpu", progress=False)
    history = train(net, model_kwargs["vocab_size"], model_kwargs["vocab_size"], config, callback=record,
                    batches=induction_batches)
    if steps[-1] != config.max_steps:  # a run whose length is not a multiple of record_every
        measure(config.max_steps, net)
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
        **({"head_scores_every": record_every, "head_scores": heads} if record_heads else {}),
        "ablation": {"means": {"n_seq": N_MEAN, "seed": MEAN_SEED, "per_position": True},
                     **ablations(net, tokens, reference)},
        "threads": torch.get_num_threads(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
    return entry, net


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 and chapter 7's model


def copying_sample(vocab_size: int, n: int = COPY_TOKENS, seed: int = COPY_SEED) -> torch.Tensor:
    """The token ids the copying scores are measured on: ``n`` of ``vocab_size``, uniformly, without replacement."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:n]


def copying_table(model: GPT, tokens: torch.Tensor, *, layers=None, log=None) -> dict:
    """Per-head summaries of :func:`~groundup.interpretability.copying_ranks` on ``tokens`` (lists [layer][head])."""
    found = {"copying": [], "hits": [], "top10": [], "median_rank": [], "eigenvalue": []}
    for layer in range(model.config.n_layers) if layers is None else layers:
        ranks = copying_ranks(model, layer, tokens=tokens, chunk=512)
        found["hits"].append([int(x) for x in (ranks == 0).sum(dim=1)])
        found["copying"].append([round(h / ranks.shape[1], DIGITS) for h in found["hits"][-1]])
        found["top10"].append([round(float(x), DIGITS) for x in (ranks < 10).float().mean(dim=1)])
        found["median_rank"].append([int(x) for x in ranks.median(dim=1).values])  # the lower of the middle two
        found["eigenvalue"].append([round(float(x), DIGITS) for x in ov_eigenvalue_scores(model, layer)])
        if log:
            log(f"layer {layer}: copying {found['copying'][-1]}, median rank {found['median_rank'][-1]}")
    return found


def lens_windows(ids: torch.Tensor, n_windows: int | None, length: int) -> torch.Tensor:
    """``(n_windows, length)`` windows of the 1-D ``ids``, starting at evenly spaced offsets (``None``: every
    whole non-overlapping window, from the start)."""
    if n_windows is None:
        n_windows = ids.numel() // length
        return ids[:n_windows * length].view(n_windows, length)
    stride = ids.numel() // n_windows
    if stride < length:
        raise ValueError(f"{n_windows} windows of {length} tokens do not fit in {ids.numel()} tokens")
    return torch.stack([ids[k * stride:k * stride + length] for k in range(n_windows)])


def lens_statistics(model: GPT, windows: torch.Tensor, *, batch: int = 4, per_window: bool = False) -> dict:
    """The logit lens (eq. 14.8) on ``windows (n, w + 1)`` of token ids, predicting tokens 1 .. w of each from
    those before; summarised per stream entry (see the module docstring). ``hits``: per entry, the positions where
    the lens's argmax is the next token; with ``per_window`` also ``window_hits``, those counts per window. One
    entry's logits at a time, ``batch`` windows at a time, so SmolLM2's 31 x 49,152 logits a position are never
    all held."""
    n, entries = windows.shape[0], model.config.n_layers + 1
    hits = torch.zeros(entries, n, dtype=torch.long)
    right, prob, nll, rank = [], [], [], []  # per batch: (entries, positions)
    for start in range(0, n, batch):
        ids = windows[start:start + batch]
        target = ids[:, 1:, None]
        stream = residual_stream(model, ids[:, :-1])
        cols = ([], [], [], [])
        with torch.no_grad():
            for layer, x in enumerate(stream):
                logits = model.unembedding(model.final_norm(x)).float()
                top = logits.argmax(dim=-1) == target[..., 0]  # (batch, w)
                hits[layer, start:start + ids.shape[0]] = top.sum(dim=1)
                own = logits.gather(-1, target)
                logp = (own - logits.logsumexp(dim=-1, keepdim=True))[..., 0]
                above = (logits > own).sum(dim=-1)  # how many tokens the lens puts above the right one
                for col, value in zip(cols, (top, logp.exp(), -logp, above)):
                    col.append(value.flatten())
        for store_, col in zip((right, prob, nll, rank), cols):
            store_.append(torch.stack(col))
    right, prob, nll, rank = (torch.cat(x, dim=1) for x in (right, prob, nll, rank))
    stays = right.flip(0).cummin(dim=0).values.flip(0)  # right from this entry to the last
    solved = right[-1]
    first = (~stays).sum(dim=0)[solved].float()  # the entries before it stays right
    return {"n_windows": n, "window_tokens": windows.shape[1], "positions": right.shape[1],
            "hits": hits.sum(dim=1).tolist(), **({"window_hits": hits.tolist()} if per_window else {}),
            "top1": [round(float(x), DIGITS) for x in right.float().mean(dim=1)],
            "prob": [round(float(x), DIGITS) for x in prob.double().mean(dim=1)],
            "nll": [round(float(x), DIGITS) for x in nll.double().mean(dim=1)],
            "median_rank": [int(x) for x in rank.median(dim=1).values],
            "solved": round(float(solved.float().mean()), DIGITS),
            "first_stays": round(float(first.mean()), DIGITS) if first.numel() else None}


def validation_text() -> str:
    """The validation text of both lenses: the last 10 % of the Shakespeare corpus."""
    return train_val_split(load_corpus("shakespeare"))[1]


def _arithmetic() -> dict:
    return {"threads": torch.get_num_threads(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def measure(name: str) -> dict:
    """Make the entry ``name`` (one of ``ENTRIES``); returns it, wall time included."""
    tick = time.perf_counter()
    if name == "chapter7-lens":
        from groundup.training import chapter7_model

        model, tok = chapter7_model()
        windows = lens_windows(torch.tensor(tok.encode(validation_text())), None, model.config.context_length + 1)
        entry = {"model": "chapter 7's GPT (groundup.training.chapter7_model)", "text": "validation, characters",
                 **lens_statistics(model, windows, batch=64)}
    else:
        from groundup.pretrained import load_smollm2

        model, tok = load_smollm2()
        model.eval()
        if name == "smollm2-copying":
            tokens = copying_sample(model.config.vocab_size)
            entry = {"model": "SmolLM2-135M-Instruct (groundup.pretrained.load_smollm2)",
                     "tokens": {"n": tokens.numel(), "seed": COPY_SEED, "draw": "torch.randperm(vocab_size)[:n]"},
                     **copying_table(model, tokens, log=lambda m: print(m, flush=True))}
        else:
            windows = lens_windows(torch.tensor(tok.encode(validation_text())), LENS_WINDOWS, LENS_WINDOW_TOKENS)
            entry = {"model": "SmolLM2-135M-Instruct (groundup.pretrained.load_smollm2)",
                     "text": "validation, SmolLM2 tokens, windows at evenly spaced offsets",
                     **lens_statistics(model, windows, per_window=True)}
    return {**entry, **_arithmetic(), "wall_seconds": round(time.perf_counter() - tick, 1)}


def store(key: str, entry: dict, section: str = "runs") -> None:
    """Add one entry to the JSON file (several commands may run at once: see tools/results_file.py)."""
    add_entry(OUT, key, entry, section=section, header={
        "about": ("Induction-head runs for chapter 14 (one CPU thread each); see tools/ch14_results.py's docstring "
                  "for what is measured and the phase-change rule. Each entry says which command made it.")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, action="append", help="a seed (repeatable; default: 0, 1, 2)")
    p.add_argument("--entry", choices=ENTRIES, action="append",
                   help="measure SmolLM2 or chapter 7's model instead of training (repeatable)")
    p.add_argument("--windows", action="store_true",
                   help="only recompute the stored runs' phase-change windows from their stored curves")
    args = p.parse_args(argv)
    if args.windows:
        for key, pc in recompute_windows().items():
            print(f"{key}: {pc}")
        return
    torch.set_num_threads(1)
    if args.entry:
        for name in args.entry:
            entry = measure(name)
            entry = {"command": ("OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default "
                                 f"python tools/ch14_results.py --entry {name}"), **entry}
            store(name, entry, section="measurements")
            print(f"{name}: {entry['wall_seconds']} s", {k: v for k, v in entry.items() if k != "hits"}, flush=True)
        return
    for seed in args.seed or [0, 1, 2]:
        if seed < 0:
            p.error(f"--seed must be a non-negative integer, got {seed}")
    for seed in args.seed or [0, 1, 2]:
        entry, _ = run_seed(seed)
        entry = {"command": f"OMP_NUM_THREADS=1 python tools/ch14_results.py --seed {seed}", **entry}
        store(f"seed{seed}", entry)
        pc, s = entry["phase_change"], entry["scores"]
        print(f"seed {seed}: {entry['wall_seconds']} s, phase change {pc}, prev-token {s['previous_token']}, "
              f"induction {s['induction']}, ablation {entry['ablation']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
