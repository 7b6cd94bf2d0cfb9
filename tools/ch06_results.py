"""The multi-seed runs behind chapter 6's Post-LN / Pre-LN experiment, stored in src/groundup/results/chapter06.json.

    OMP_NUM_THREADS=1 python tools/ch06_results.py                               # all 9 runs
    OMP_NUM_THREADS=1 python tools/ch06_results.py --variant post --seed 1       # one entry

Every run trains a deep, narrow GPT (``groundup.models.GPT``: 24 layers, d_model 64, 4 heads, learned positions,
LayerNorm, d_FFN = 4 d_model, no dropout, tied embeddings, the package's GPT-2 initialisation: N(0, 0.02²) weights,
the residual-branch projections scaled by 1/sqrt(2 n_L)) on character-level tiny Shakespeare (GROUNDUP_DATA_DIR
must point at the corpus) with ``groundup.training.train``: AdamW (betas 0.9, 0.99, weight decay 0.1), peak
learning rate 2e-3 (unless stated), cosine decay to a tenth of it, gradient clipping at norm 1, batch 16
windows of 32 characters, 200 steps, one CPU thread. Three variants:

- ``post``: Post-LN (``norm_position="post"``), no warm-up (the learning rate starts at its peak);
- ``post_warmup``: Post-LN, learning rate warmed up linearly over the first 50 steps;
- ``pre``: Pre-LN (``norm_position="pre"``), no warm-up;

and two more (only with ``--variant``): ``post_lr1e-3`` and ``post_warmup_lr1e-3``, the two Post-LN runs with peak
learning rate 1e-3 (cosine decay to 1e-4).

The entry ``corpus`` holds the unigram entropy of the training characters (``--stats`` stores only it).
Each run's entry stores the validation loss (10 fixed batches) every 25 steps, the training loss and the gradient norm
(before clipping) of every step, and the command that made it; running a command again replaces its entry.
The runs are deterministic on one thread, so the stored numbers are what the command prints.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path

import torch

from groundup.data import load_corpus, train_val_split
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import CharTokenizer
from groundup.training import TrainConfig, train
from groundup.utils import atomic_write_text

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter06.json"
VARIANTS = {  # name in the command: (name in the notebook, norm_position, warmup_steps, peak learning rate)
    "post": ("Post-LN, no warm-up", "post", 0, 2e-3),
    "post_warmup": ("Post-LN, 50-step warm-up", "post", 50, 2e-3),
    "pre": ("Pre-LN, no warm-up", "pre", 0, 2e-3),
    "post_lr1e-3": ("Post-LN, no warm-up, peak 1e-3", "post", 0, 1e-3),
    "post_warmup_lr1e-3": ("Post-LN, 50-step warm-up, peak 1e-3", "post", 50, 1e-3),
}
MAIN = ("post", "post_warmup", "pre")  # what runs without --variant
SHAPE = dict(context_length=32, d_model=64, n_layers=24, n_heads=4)
STEPS = 200


def run(variant: str, seed: int) -> dict:
    label, norm_position, warmup, learning_rate = VARIANTS[variant]
    text = load_corpus("tinyshakespeare")
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(torch.tensor(tokenizer.encode(text)), 0.1)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, norm_position=norm_position, **SHAPE))
    config = TrainConfig(batch_size=16, max_steps=STEPS, learning_rate=learning_rate, warmup_steps=warmup,
                         eval_interval=25, eval_batches=10, seed=seed, progress=False)
    history = train(model, train_ids, val_ids, config)
    return {"variant": variant, "label": label, "seed": seed, "norm_position": norm_position,
            "warmup_steps": warmup, "learning_rate": learning_rate, "steps": STEPS, "batch_size": 16,
            "shape": SHAPE, "vocab_size": tokenizer.vocab_size,
            "eval_step": history.eval_step, "val_loss": [round(v, 5) for v in history.val_loss],
            "train_loss": [round(v, 4) for v in history.train_loss],
            "grad_norm": [round(v, 4) for v in history.grad_norm],
            "command": f"python tools/ch06_results.py --variant {variant} --seed {seed}"}


def corpus_stats() -> dict:
    """The unigram entropy of the training characters: the loss of predicting each from its frequency alone."""
    text = load_corpus("tinyshakespeare")
    tokenizer = CharTokenizer.from_text(text)
    train_ids, _ = train_val_split(torch.tensor(tokenizer.encode(text)), 0.1)
    p = torch.bincount(train_ids, minlength=tokenizer.vocab_size).double() / len(train_ids)
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return {"unigram_entropy": round(entropy, 5), "train_tokens": len(train_ids), "vocab_size": tokenizer.vocab_size}


def store(key: str, entry: dict) -> None:
    """Add one entry to the JSON file (locked, so several commands may run at once)."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(OUT.parent, os.O_RDONLY)  # lock the folder, so no lock file is left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        results = json.loads(OUT.read_text()) if OUT.exists() else {}
        results[key] = entry
        results = dict(sorted(results.items()))
        atomic_write_text(OUT, json.dumps(results, indent=1) + "\n")
    finally:
        os.close(fd)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), help="one variant (default: the three main ones)")
    p.add_argument("--seed", type=int, help="one seed (default: 0, 1, 2)")
    p.add_argument("--stats", action="store_true", help="only store the corpus statistics (no training)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    store("corpus", corpus_stats())
    if args.stats:
        return
    variants = [args.variant] if args.variant else list(MAIN)
    seeds = [args.seed] if args.seed is not None else [0, 1, 2]
    for seed in seeds:
        for variant in variants:
            entry = run(variant, seed)
            store(f"{variant}/seed{seed}", entry)
            print(f"{variant} seed {seed}: final validation loss {entry['val_loss'][-1]:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
