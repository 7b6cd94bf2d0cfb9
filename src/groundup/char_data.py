"""A named corpus as character-level training data: the tokenizer and the two splits of its ids.

    tokenizer, train_ids, val_ids = char_corpus("tinyshakespeare")

is the three lines chapters 3 to 9 write out (and the tools that make their stored results run):

    text = load_corpus("tinyshakespeare")
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(torch.tensor(tokenizer.encode(text)), 0.1)

It lives beside :mod:`groundup.data` rather than in it because it needs :mod:`groundup.tokenizers`, which itself
reads GPT-2's ranks through :mod:`groundup.data`.
"""

from __future__ import annotations

import os

import torch

from groundup.data import load_corpus, train_val_split
from groundup.tokenizers import CharTokenizer

__all__ = ["char_corpus"]


def char_corpus(name: str = "shakespeare", *, val_fraction: float = 0.1,
                cache_dir: str | os.PathLike | None = None) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """The corpus ``name`` at the character level: ``(tokenizer, train_ids, val_ids)``.

    The vocabulary is every distinct character of the text, sorted (:meth:`CharTokenizer.from_text`); the ids of
    the whole text, a 1-D ``torch.long`` tensor, are split into the first ``1 - val_fraction`` for training and
    the last ``val_fraction`` for validation (:func:`~groundup.data.train_val_split`, contiguous, not shuffled).
    ``name`` and ``cache_dir`` are those of :func:`~groundup.data.load_corpus`, which downloads, verifies and
    caches the text on first use; an unknown name or a ``val_fraction`` outside (0, 1) is refused there, with a
    message naming the argument.
    """
    text = load_corpus(name, cache_dir=cache_dir)
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(torch.tensor(tokenizer.encode(text)), val_fraction)
    return tokenizer, train_ids, val_ids
