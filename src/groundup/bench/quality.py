"""Quality runs (minutes each, so not part of plain ``make bench``): ``python -m groundup.bench quality``.

The book's CPU recipe (``groundup train``'s defaults) on tiny Shakespeare at the character level, the first 90 %
for training and the last 10 % for validation exactly as nanoGPT's ``shakespeare_char``, so the numbers compare
with its published ones (its CPU recipe: 1.88 after 1.54 M training tokens; its GPU "baby GPT": about 1.47 after
82 M tokens). Two runs, each scored on the whole validation text at the end:

* a token budget: at most 1.0 M training tokens (target: validation loss <= 1.80);
* a time budget: 10 minutes of training on this machine, the cosine running over the time (target: <= 1.55).
"""

from __future__ import annotations

import math
import time

import torch

from groundup.bench import Row
from groundup.char_data import char_corpus
from groundup.models import GPT, GPTConfig
from groundup.runs import RECIPE_MODEL, RECIPE_TRAINING
from groundup.training import TrainConfig, evaluate, train

TOKEN_BUDGET = 1_000_000
TIME_BUDGET = 600.0


def _run(train_ids, val_ids, vocab_size: int, seed: int = 0, **overrides):
    """Train the recipe's model (initialised and fed batches from ``seed``); its loss on the whole validation text."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, **RECIPE_MODEL))
    config = TrainConfig(**{**RECIPE_TRAINING, "progress": False, "seed": seed, **overrides})
    start = time.perf_counter()
    history = train(model, train_ids, val_ids, config)
    wall = time.perf_counter() - start
    return evaluate(model, val_ids, batch_size=64), history, wall


def run() -> list[Row]:
    tokenizer, train_ids, val_ids = char_corpus("tinyshakespeare")
    tokens_per_step = RECIPE_TRAINING["batch_size"] * RECIPE_MODEL["context_length"]
    rows = []
    steps = TOKEN_BUDGET // tokens_per_step
    loss, history, wall = _run(train_ids, val_ids, tokenizer.vocab_size, max_steps=steps,
                               warmup_steps=min(RECIPE_TRAINING["warmup_steps"], steps))
    rows.append(Row("validation loss, 1.0 M-token budget", loss, "nats",
                    f"{steps} steps, {steps * tokens_per_step:,} tokens, {wall / 60:.1f} min (target <= 1.80)"))
    loss, history, wall = _run(train_ids, val_ids, tokenizer.vocab_size, max_steps=10**9, time_budget=TIME_BUDGET)
    rows.append(Row("validation loss, 10-minute budget", loss, "nats",
                    f"{history.step[-1]} steps, {history.tokens[-1]:,} tokens, {history.seconds[-1] / 60:.1f} min of "
                    f"training, {wall / 60:.1f} min with evaluations (target <= 1.55)"))
    rows.append(Row("  same, bits per character", loss / math.log(2), "bits", ""))
    return rows
