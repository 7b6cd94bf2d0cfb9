"""One trial of the search for the command line's CPU recipe (chapter 7), on tiny Shakespeare at the character level.

    python tools/recipe_trial.py NAME --steps 7500 --lr 2e-3 --context 128 --d-model 192 --layers 4 --heads 6 \\
        --batch-size 8 [--warmup 50] [--positional rope] [--seed 0] [--threads 1] [--out results.jsonl]

The split is nanoGPT's ``shakespeare_char`` one (the first 90 % for training, the last 10 % for validation), the
training is the package's :func:`groundup.training.train` with the recipe's other settings (AdamW, weight decay
0.1 on matrices, clipping at 1, warm-up then cosine to a tenth of the peak), and the score is the loss on the
whole validation text at the end. One line of JSON per trial is appended to ``--out``.

A trial is given a number of steps, not a time: the search ran two trials at once on one thread each, so it
could not time them. The step budget of a "10-minute" trial is what 10 minutes of training on this machine's
two threads allow, from a step time measured alone on a quiet machine (``--steps`` = 600 s / that time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from groundup.char_data import char_corpus
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, evaluate, train


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--positional", default="rope")
    p.add_argument("--min-lr", type=float, default=None, help="end of the cosine (default: lr / 10)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="recipe_search.jsonl")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tokenizer, train_ids, val_ids = char_corpus("tinyshakespeare")
    torch.manual_seed(a.seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=a.context, d_model=a.d_model,
                          n_layers=a.layers, n_heads=a.heads, positional=a.positional, dropout=0.0))
    config = TrainConfig(batch_size=a.batch_size, context_length=a.context, max_steps=a.steps, learning_rate=a.lr,
                         min_lr=a.min_lr, warmup_steps=a.warmup, weight_decay=0.1, grad_clip=1.0,
                         optimizer=a.optimizer,
                         eval_interval=max(a.steps // 8, 1),
                         eval_batches=20, seed=a.seed, progress=False)
    start = time.perf_counter()
    history = train(model, train_ids, val_ids, config)
    result = dict(name=a.name, args={k: v for k, v in vars(a).items() if k not in ("name", "out")},
                  full_val=round(evaluate(model, val_ids, batch_size=64), 5), steps=history.step[-1],
                  tokens=history.tokens[-1], eval_step=history.eval_step,
                  val=[round(v, 4) for v in history.val_loss], wall_seconds=round(time.perf_counter() - start, 1))
    print(json.dumps(result), flush=True)
    with Path(a.out).open("a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
