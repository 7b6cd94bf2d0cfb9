"""The multi-seed runs behind chapter 2's "Use it" experiment, stored in src/groundup/results/chapter02.json.

    OMP_NUM_THREADS=1 python tools/ch02_results.py                          # everything (about half an hour)
    OMP_NUM_THREADS=1 python tools/ch02_results.py --tokenizer bpe1024 --seed 1   # one entry

One small GPT per tokenizer and seed, each trained on one CPU thread (so the numbers are the same on every run of
this script). The tokenizers: the corpus's characters (``chars``, 84 tokens) and the chapter's byte-level BPE
trained on the first 1 MB of the corpus with the GPT-2 pattern, cut to 512, 1024, 2048 and 4096 tokens (the
first ``n_V - 256`` merges of one 4096-token run, as in the notebook's compression plot).

The text is the Gutenberg Shakespeare corpus, split by characters: the first 90 % for training, the last 10 % for
validation; each part is encoded on its own. Every model has the same shape and the same training budget in
tokens: ``GPT(vocab_size=n_V, **SHAPE)`` trained with ``TRAINING`` (the same number of steps, batch size and
context length, so the same number of training tokens; a larger vocabulary therefore sees more bytes of text and
a longer stretch of text per context, and has a larger (tied) embedding matrix).

Scoring: the whole validation text, cut into non-overlapping windows of ``context_length + 1`` tokens starting
every ``context_length`` tokens (as ``groundup.training.evaluate`` does); every token after the first of its
window is predicted once. ``nats`` is the summed cross-entropy over those predictions, ``bytes`` the number of
UTF-8 bytes those predicted tokens decode to, and

    loss per token = nats / tokens,        loss per byte = nats / bytes = loss per token / bytes per token.

Each entry records the command that made it; running a command again replaces its entry.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import add_entry

from groundup.data import load_corpus
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import BPETokenizer, CharTokenizer
from groundup.training import TrainConfig, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter02.json"
TOKENIZERS = {"chars": None, "bpe512": 512, "bpe1024": 1024, "bpe2048": 2048, "bpe4096": 4096}
SHAPE = dict(context_length=64, d_model=64, n_layers=2, n_heads=4, positional="rope")
TRAINING = dict(batch_size=16, max_steps=1500, learning_rate=3e-3, warmup_steps=100, eval_interval=1500,
                eval_batches=10)
TRAIN_BYTES = 1_000_000  # the BPE tokenizers are trained on corpus[:TRAIN_BYTES], as in the notebook


def tokenizers(text: str) -> dict:
    """name -> tokenizer, for every entry of TOKENIZERS."""
    big = BPETokenizer.train(text[:TRAIN_BYTES], max(n for n in TOKENIZERS.values() if n))
    out = {}
    for name, n_v in TOKENIZERS.items():
        out[name] = CharTokenizer.from_text(text) if n_v is None else BPETokenizer(big.merges[: n_v - 256])
    return out


def token_bytes(tokenizer) -> torch.Tensor:
    """The number of UTF-8 bytes each token id decodes to."""
    return torch.tensor([len(tokenizer.decode([i]).encode("utf-8")) if isinstance(tokenizer, CharTokenizer)
                         else len(tokenizer.vocab[i]) for i in range(tokenizer.vocab_size)])


def score(model: GPT, val_ids: torch.Tensor, lengths: torch.Tensor, batch_size: int = 32) -> dict:
    """Summed nats and bytes over the whole validation text (non-overlapping windows, see the module text)."""
    n_c = model.config.context_length
    starts = torch.arange(0, len(val_ids) - n_c, n_c)
    offsets = torch.arange(n_c + 1)
    nats, tokens, n_bytes = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for chunk in starts.split(batch_size):
            windows = val_ids[chunk[:, None] + offsets]
            logits, _ = model(windows[:, :-1])
            targets = windows[:, 1:]
            nats += F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
            n_bytes += int(lengths[targets].sum())
    return {"nats": round(nats, 2), "tokens": tokens, "bytes": n_bytes,
            "loss_per_token": round(nats / tokens, 5), "loss_per_byte": round(nats / n_bytes, 5),
            "bits_per_byte": round(nats / n_bytes / math.log(2), 5), "bytes_per_token": round(n_bytes / tokens, 5)}


def run(name: str, tokenizer, text: str, seed: int) -> dict:
    cut = int(0.9 * len(text))
    train_ids = torch.tensor(tokenizer.encode(text[:cut]))
    val_ids = torch.tensor(tokenizer.encode(text[cut:]))
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **SHAPE))
    history = train(model, train_ids, val_ids, TrainConfig(**TRAINING, seed=seed, progress=False))
    return {"vocab_size": tokenizer.vocab_size, "parameters": sum(p.numel() for p in model.parameters()),
            "train_tokens": len(train_ids), "final_train_loss": round(history.train_loss[-1], 5),
            **score(model, val_ids, token_bytes(tokenizer))}


def store(key: str, entry: dict) -> None:
    add_entry(OUT, key, entry, header={
        "about": ("Runs for chapter 2's 'Use it' section (one CPU thread each, see tools/ch02_results.py); "
                  "each entry says which command made it."),
        "setup": {"shape": SHAPE, "training": TRAINING, "bpe_trained_on_characters": TRAIN_BYTES,
                  "split": "first 90 % of the corpus's characters for training, last 10 % for validation"}})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", choices=tuple(TOKENIZERS), action="append")
    p.add_argument("--seed", type=int, action="append")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    text = load_corpus("shakespeare")
    toks = tokenizers(text)
    for seed in a.seed or [0, 1, 2]:
        for name in a.tokenizer or list(TOKENIZERS):
            key = f"{name}/seed{seed}"
            command = f"OMP_NUM_THREADS=1 python tools/ch02_results.py --tokenizer {name} --seed {seed}"
            entry = {"tokenizer": name, "seed": seed, **run(name, toks[name], text, seed)}
            store(key, {"command": command, **entry})
            print(key, entry, flush=True)


if __name__ == "__main__":
    sys.exit(main())
