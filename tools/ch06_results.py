"""The multi-seed runs behind chapter 6's Post-LN / Pre-LN experiment, stored in src/groundup/results/chapter06.json.

    OMP_NUM_THREADS=1 python tools/ch06_results.py                               # the 9 main runs
    OMP_NUM_THREADS=1 python tools/ch06_results.py --confounds                   # the 9 confound runs
    OMP_NUM_THREADS=1 python tools/ch06_results.py --variant post --seed 1       # one entry

Every run trains a deep, narrow GPT (``groundup.models.GPT``: 24 layers, d_model 64, 4 heads, learned positions,
LayerNorm, d_FFN = 4 d_model, no dropout, tied embeddings, the package's GPT-2 initialisation: N(0, 0.02²) weights,
the residual-branch projections scaled by 1/sqrt(2 n_L)) on character-level tiny Shakespeare (GROUNDUP_DATA_DIR
must point at the corpus) with ``groundup.training.train``: AdamW (betas 0.9, 0.99, weight decay 0.1), peak
learning rate 2e-3 (unless stated), cosine decay to a tenth of it, gradient clipping at norm 1, batch 16
windows of 32 characters, 200 steps, one CPU thread (unless stated). Three main variants:

- ``post``: Post-LN (``norm_position="post"``), no warm-up (the learning rate starts at its peak);
- ``post_warmup``: Post-LN, learning rate warmed up linearly over the first 50 steps;
- ``pre``: Pre-LN (``norm_position="pre"``), no warm-up;

two more (only with ``--variant``): ``post_lr1e-3`` and ``post_warmup_lr1e-3``, the two Post-LN runs with peak
learning rate 1e-3 (cosine decay to 1e-4); and the three confounds (``--confounds``): ``post_warmup`` with one
setting changed each,

- ``post_warmup_noclip``: no gradient clipping;
- ``post_warmup_noscale``: ``W_o`` and ``W_out`` at N(0, 0.02²) like every other weight, without the
  1/sqrt(2 n_L) (the same random draws as ``post_warmup``, multiplied back by sqrt(2 n_L));
- ``post_warmup_800``: 800 steps instead of 200 (the cosine stretched over them, the warm-up still 50 steps).

The entry ``corpus`` holds the unigram entropy of the training characters (``--stats`` stores only it).
Each run's entry stores its settings, the validation loss (10 fixed batches) every 25 steps, the training loss and
the gradient norm (before clipping) of every step, and the command that made it; running a command again replaces
its entry. The runs are deterministic on one thread, so the stored numbers are what the command prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from results_file import add_entry

from groundup.char_data import char_corpus
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter06.json"


class Variant(NamedTuple):
    label: str  # the name in the notebook
    norm_position: str
    warmup_steps: int
    learning_rate: float  # the peak
    grad_clip: float | None = 1.0
    residual_scaling: bool = True  # W_o and W_out at 0.02 / sqrt(2 n_L) (False: 0.02)
    steps: int = 200


VARIANTS = {  # the name in the command: its settings
    "post": Variant("Post-LN, no warm-up", "post", 0, 2e-3),
    "post_warmup": Variant("Post-LN, 50-step warm-up", "post", 50, 2e-3),
    "pre": Variant("Pre-LN, no warm-up", "pre", 0, 2e-3),
    "post_lr1e-3": Variant("Post-LN, no warm-up, peak 1e-3", "post", 0, 1e-3),
    "post_warmup_lr1e-3": Variant("Post-LN, 50-step warm-up, peak 1e-3", "post", 50, 1e-3),
    "post_warmup_noclip": Variant("Post-LN, 50-step warm-up, no clipping", "post", 50, 2e-3, grad_clip=None),
    "post_warmup_noscale": Variant("Post-LN, 50-step warm-up, no 1/sqrt(2 n_L)", "post", 50, 2e-3,
                                   residual_scaling=False),
    "post_warmup_800": Variant("Post-LN, 50-step warm-up, 800 steps", "post", 50, 2e-3, steps=800),
}
MAIN = ("post", "post_warmup", "pre")  # what runs without --variant
CONFOUNDS = ("post_warmup_noclip", "post_warmup_noscale", "post_warmup_800")  # what --confounds runs
SHAPE = dict(context_length=32, d_model=64, n_layers=24, n_heads=4)


def build_model(variant: str, seed: int, vocab_size: int) -> GPT:
    """The variant's GPT, initialised from ``seed``; without residual scaling ``W_o`` and ``W_out`` are the same
    draws multiplied by sqrt(2 n_L), so only that one setting differs from the scaled model."""
    v = VARIANTS[variant]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, norm_position=v.norm_position, **SHAPE))
    if not v.residual_scaling:
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith("attention.W_o") or name.endswith("ffn.W_out"):
                    module.weight.mul_(math.sqrt(2 * model.config.n_layers))
    return model


def run(variant: str, seed: int) -> dict:
    v = VARIANTS[variant]
    tokenizer, train_ids, val_ids = char_corpus("tinyshakespeare")
    model = build_model(variant, seed, tokenizer.vocab_size)
    config = TrainConfig(batch_size=16, max_steps=v.steps, learning_rate=v.learning_rate,
                         warmup_steps=v.warmup_steps, grad_clip=v.grad_clip, eval_interval=25, eval_batches=10,
                         seed=seed, progress=False)
    history = train(model, train_ids, val_ids, config)
    return {"variant": variant, "label": v.label, "seed": seed, "norm_position": v.norm_position,
            "warmup_steps": v.warmup_steps, "learning_rate": v.learning_rate, "grad_clip": v.grad_clip,
            "residual_scaling": v.residual_scaling, "steps": v.steps, "batch_size": 16,
            "shape": SHAPE, "vocab_size": tokenizer.vocab_size,
            "eval_step": history.eval_step, "val_loss": [round(x, 5) for x in history.val_loss],
            "train_loss": [round(x, 4) for x in history.train_loss],
            "grad_norm": [round(x, 4) for x in history.grad_norm],
            "command": f"python tools/ch06_results.py --variant {variant} --seed {seed}"}


def corpus_stats() -> dict:
    """The unigram entropy of the training characters: the loss of predicting each from its frequency alone."""
    tokenizer, train_ids, _ = char_corpus("tinyshakespeare")
    p = torch.bincount(train_ids, minlength=tokenizer.vocab_size).double() / len(train_ids)
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return {"unigram_entropy": round(entropy, 5), "train_tokens": len(train_ids), "vocab_size": tokenizer.vocab_size}


def store(key: str, entry: dict) -> None:
    """Add one entry to the JSON file (several commands may run at once: see tools/results_file.py)."""
    add_entry(OUT, key, entry, section=None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), help="one variant (default: the three main ones)")
    p.add_argument("--confounds", action="store_true", help="the three confound variants instead of the main ones")
    p.add_argument("--seed", type=int, help="one seed (default: 0, 1, 2)")
    p.add_argument("--stats", action="store_true", help="only store the corpus statistics (no training)")
    args = p.parse_args(argv)
    if args.variant and args.confounds:
        p.error("--variant and --confounds: give one of them")
    torch.set_num_threads(1)
    store("corpus", corpus_stats())
    if args.stats:
        return
    variants = [args.variant] if args.variant else list(CONFOUNDS if args.confounds else MAIN)
    seeds = [args.seed] if args.seed is not None else [0, 1, 2]
    for seed in seeds:
        for variant in variants:
            entry = run(variant, seed)
            store(f"{variant}/seed{seed}", entry)
            print(f"{variant} seed {seed}: final validation loss {entry['val_loss'][-1]:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
