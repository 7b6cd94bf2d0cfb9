"""Chapter 8's decoding-settings sweep, stored in src/groundup/results/chapter08.json.

    python tools/ch08_results.py        # about 80 s on one thread

For every decoding setting of ``SETTINGS`` and every seed of ``SEEDS``, chapter 7's model
(:func:`groundup.training.chapter7_model`, in eval mode) writes ``N_SAMPLES`` samples of ``N_NEW`` characters after
``PROMPT`` with :func:`groundup.generation.generate` (``generator=torch.Generator().manual_seed(seed)``), and the
samples are measured as the notebook's "Use it" section explains:

- ``diversity``: :func:`distinct_bigrams` of the samples' texts (the characters after the prompt);
- ``repetition``: the mean over the samples of :func:`repetition` (the fraction of 10-character strings that
  already occurred earlier in the same sample);
- ``own_loss``: the mean over the samples of the model's own mean loss on the generated characters
  (:func:`mean_loss`, chapter 8's definition: consecutive windows of the model's context, each starting afresh);
- ``repeating``: how many samples have a repetition above 0.

The entry ``runs["decoding-sweep"]`` keeps, per setting, one row ``[diversity, repetition, own_loss, repeating]``
per seed (the floats exactly as computed: JSON writes a float so that it reads back the same), and seed 0's
token ids (prompt included, ``N_SAMPLES`` rows), which the chapter decodes and judges. It is exactly what the
notebook's cell computed before it loaded this file: the same calls, on the same arithmetic the notebooks run
on (``nbval_lanes.ARITHMETIC``: every library that picks code for the CPU capped; set here if the shell did not)
and on one thread, as the notebook sets. The entry records the command, the machine and its wall time (the one
number that is not reproducible). Running the command again replaces it.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from results_file import add_entry, machine, on_notebook_arithmetic

if __name__ == "__main__":
    on_notebook_arithmetic()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import groundup  # noqa: E402
from groundup.generation import generate  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter08.json"
KEY = "decoding-sweep"
COMMAND = "python tools/ch08_results.py"
PROMPT = "KING.\nMy lord, "

# The notebook's definitions (tests/test_ch08_results.py checks that they compute the same).
SETTINGS = {
    "greedy": dict(greedy=True),
    "T = 0.5": dict(temperature=0.5),
    "T = 1.0": dict(temperature=1.0),
    "T = 1.5": dict(temperature=1.5),
    "top-k 5": dict(top_k=5),
    "top-p 0.9": dict(top_p=0.9),
    "T 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9),
}
N_SAMPLES, N_NEW, SEEDS = 8, 150, [0, 1, 2]


def distinct_bigrams(texts):
    pairs = [tuple(w[i:i + 2]) for w in (t.split() for t in texts)
             for i in range(len(w) - 1)]
    return len(set(pairs)) / max(len(pairs), 1)


def repetition(t, n=10):
    grams = [t[i:i + n] for i in range(len(t) - n + 1)]
    seen, repeated = set(), 0
    for s in grams:
        repeated += s in seen
        seen.add(s)
    return repeated / len(grams)


def mean_loss(model, ids):
    """The model's mean next-token loss (nats per token) on each row of ids (batch, L),
    predicting tokens 2..L in consecutive windows of n_C (each window starts afresh, as
    when the validation loss is measured)."""
    n_C = model.config.context_length
    batch, L = ids.shape
    n_windows = math.ceil((L - 1) / n_C)
    padded = torch.full((batch, n_windows * n_C + 1), -100)
    padded[:, :L] = ids
    starts = torch.arange(n_windows) * n_C
    inputs = torch.stack([padded[:, s:s + n_C] for s in starts], dim=1).reshape(-1, n_C)
    targets = (torch.stack([padded[:, s + 1:s + n_C + 1] for s in starts], dim=1)
               .reshape(-1, n_C))
    with torch.no_grad():
        # padding (-100) only ever appears as an ignored target
        logits, _ = model(inputs.clamp(min=0))
    losses = (F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
              .reshape(batch, -1))
    counted = (targets != -100).reshape(batch, -1)
    return (losses.sum(-1) / counted.sum(-1)).tolist()


def sample(model, prompt, name, seed):
    """The notebook's ``sample``: N_SAMPLES samples of N_NEW characters with the setting ``name``, prompt
    included."""
    return generate(model, prompt.repeat(N_SAMPLES, 1), N_NEW,
                    generator=torch.Generator().manual_seed(seed), **SETTINGS[name])


def measure_row(model, tokenizer, prompt, ids):
    """The notebook's ``measure``: (diversity, mean repetition, own loss, samples repeating) of one seed's
    samples ``ids``."""
    texts = [tokenizer.decode(row[prompt.shape[1]:].tolist()) for row in ids]
    # the generated characters
    loss = statistics.mean(mean_loss(model, ids[:, prompt.shape[1] - 1:]))
    reps = [repetition(t) for t in texts]
    repeating = sum(rep > 0 for rep in reps)  # samples with at least one repeat
    return distinct_bigrams(texts), statistics.mean(reps), loss, repeating


def sweep(model, tokenizer, prompt, names=tuple(SETTINGS), seeds=SEEDS):
    """``(results, sample_ids)``: ``results[name]``, one :func:`measure_row` per seed; ``sample_ids[name]``, the
    first seed's samples."""
    results, sample_ids = {}, {}
    for name in names:
        rows = []
        for seed in seeds:
            ids = sample(model, prompt, name, seed)
            rows.append(measure_row(model, tokenizer, prompt, ids))
            sample_ids.setdefault(name, ids)
        results[name] = rows
    return results, sample_ids


def measure() -> dict:
    """The entry: chapter 7's model, one thread, the sweep."""
    from groundup.training import chapter7_model

    tick = time.perf_counter()
    groundup.set_seed(0)
    torch.set_num_threads(1)  # as the notebook
    model, tokenizer = chapter7_model()
    model.eval()
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    results, sample_ids = sweep(model, tokenizer, prompt)
    return {"command": COMMAND,
            "model": "chapter 7's GPT (groundup.training.chapter7_model), eval mode",
            "prompt": PROMPT, "settings": SETTINGS, "n_samples": N_SAMPLES, "n_new": N_NEW, "seeds": SEEDS,
            "columns": ["diversity", "repetition", "own_loss", "repeating"],
            "results": {name: [list(row) for row in rows] for name, rows in results.items()},
            "sample_ids": {name: ids.tolist() for name, ids in sample_ids.items()},
            "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


def main() -> None:
    entry = measure()
    add_entry(OUT, KEY, entry, header={
        "about": ("Chapter 8's decoding-settings sweep on chapter 7's model; see tools/ch08_results.py's docstring "
                  "for what is measured. Made by the command each entry names."),
        "arithmetic": ("tools/nbval_lanes.py's ARITHMETIC (ATen, MKL, oneDNN, glibc's libm and NumPy capped), "
                       "one thread: the arithmetic the notebooks run on, so every x86-64 CPU computes these numbers "
                       "alike")})
    print(f"{KEY}: {entry['wall_seconds']} s, stored in {OUT}")
    for name, rows in entry["results"].items():
        print(f"{name:<18}", [[round(x, 4) for x in row] for row in rows])


if __name__ == "__main__":
    main()
