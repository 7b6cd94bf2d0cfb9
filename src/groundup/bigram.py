"""Chapter 1's first language model: a count-based bigram model, and the loss and perplexity it is judged by.

A bigram model predicts the next token from the current one only:
``P(w_t | w_1, ..., w_{t-1}) ≈ P(w_t | w_{t-1}) = (count(w_{t-1}, w_t) + α) / (count(w_{t-1}) + α n_V)``.
It has no parameters to train by gradient descent -- counting *is* its maximum-likelihood training -- which makes
it the baseline every later model must beat.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch


def _count(name: str, value, *, minimum: int) -> int:
    """``value`` as an int (Python or NumPy integers), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")
    return int(value)


def _token(name: str, value) -> int:
    """One token id given as an int (Python, NumPy, or a 0-d integer tensor); floats are refused, not truncated."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer token id, got {type(value).__name__} {value!r}")
    return int(value)


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or None, "
                        f"got {type(generator).__name__} {generator!r}")


def _as_ids(ids: Sequence[int] | torch.Tensor, vocab_size: int, name: str = "ids") -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}) for vocab_size={vocab_size}, "
                         f"got values from {ids.min().item()} to {ids.max().item()}")
    return ids.long()


def bigram_counts(ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``counts[a, b]`` = how often token ``b`` directly follows token ``a`` in ``ids`` (LongTensor[n_V, n_V])."""
    vocab_size = _count("vocab_size", vocab_size, minimum=1)
    ids = _as_ids(ids, vocab_size)
    pairs = ids[:-1] * vocab_size + ids[1:]
    return torch.bincount(pairs, minlength=vocab_size * vocab_size).view(vocab_size, vocab_size)


def perplexity(loss: float) -> float:
    """Perplexity ``exp(loss)`` of a mean next-token cross-entropy given in nats."""
    return math.exp(loss)


class BigramLM:
    """A count-based bigram language model with add-α (Laplace) smoothing.

    ``BigramLM.fit(ids, vocab_size, alpha=1.0)`` counts the bigrams of ``ids``. ``probs[a, b]`` is then
    ``P(b | a)``; every row sums to 1. With ``alpha=0`` the probabilities are the maximum-likelihood estimate,
    which gives probability 0 (infinite loss) to every bigram not seen in training; ``alpha > 0`` pretends every
    bigram was seen ``alpha`` extra times.
    """

    def __init__(self, counts: torch.Tensor, *, alpha: float = 1.0):
        if not isinstance(counts, torch.Tensor):
            raise TypeError(f"counts must be a torch.Tensor of bigram counts, got {type(counts).__name__}")
        if counts.dim() != 2 or counts.shape[0] != counts.shape[1]:
            raise ValueError(f"counts must be a square [n_V, n_V] matrix, got shape {tuple(counts.shape)}")
        if counts.dtype == torch.bool or counts.is_complex():
            raise TypeError(f"counts must hold integer counts, got dtype {counts.dtype}")
        if counts.is_floating_point() and not bool((counts == counts.round()).all()):
            raise ValueError("counts must be whole numbers (they count bigrams); got fractional or non-finite "
                             "values, which would be truncated")
        if counts.numel() and bool((counts < 0).any()):
            raise ValueError(f"counts must be >= 0 (they count bigrams), got {counts.min().item()}")
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) \
                or alpha < 0:
            raise ValueError(f"alpha must be a finite non-negative number (add-α smoothing), got {alpha!r}")
        self.counts = counts.long()
        self.alpha = float(alpha)
        smoothed = self.counts.double() + self.alpha
        totals = smoothed.sum(dim=1, keepdim=True)
        # A row that was never seen and has no smoothing carries no information: predict uniformly.
        self.probs = torch.where(totals > 0, smoothed / totals.clamp(min=1e-300), 1.0 / self.vocab_size)

    @classmethod
    def fit(cls, ids: Sequence[int] | torch.Tensor, vocab_size: int, *, alpha: float = 1.0) -> BigramLM:
        """Count the bigrams of ``ids`` (a 1-D sequence of token ids below ``vocab_size``)."""
        return cls(bigram_counts(ids, vocab_size), alpha=alpha)

    @property
    def vocab_size(self) -> int:
        return self.counts.shape[0]

    def next_token_probs(self, token: int) -> torch.Tensor:
        """The distribution ``P(· | token)`` over the vocabulary."""
        token = _token("token", token)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token must lie in [0, {self.vocab_size}), got {token}")
        return self.probs[token]

    def loss(self, ids: Sequence[int] | torch.Tensor) -> float:
        """Mean next-token cross-entropy (nats) of ``ids``: ``-1/(n-1) Σ_t log P(w_t | w_{t-1})``, t = 2..n."""
        ids = _as_ids(ids, self.vocab_size)
        if len(ids) < 2:
            raise ValueError(f"ids must hold at least 2 tokens to have a next-token prediction, got {len(ids)}")
        p = self.probs[ids[:-1], ids[1:]]
        return float(-torch.log(p).mean())

    def perplexity(self, ids: Sequence[int] | torch.Tensor) -> float:
        """``exp(loss(ids))``: the effective number of equally likely next tokens the model hesitates between."""
        return perplexity(self.loss(ids))

    def sample(self, start: int, n_tokens: int, *, generator: torch.Generator | None = None) -> list[int]:
        """Generate ``n_tokens`` ids after ``start`` by repeatedly sampling ``w_t ~ P(· | w_{t-1})``."""
        n_tokens = _count("n_tokens", n_tokens, minimum=0)
        _check_generator(generator)
        start = _token("start", start)
        self.next_token_probs(start)  # validates start
        out = [start]
        for _ in range(n_tokens):
            nxt = torch.multinomial(self.probs[out[-1]], 1, generator=generator).item()
            out.append(nxt)
        return out


class NGramLM:
    """A count-based n-gram model with add-α smoothing: ``P(w_t | the n - 1 tokens before it)``.

    ``P(b | c) = (count(c, b) + α) / (count(c) + α n_V)`` for every context ``c`` of ``n - 1`` tokens; a context
    never seen in training gets the uniform distribution. ``n = 2`` is :class:`BigramLM`. Longer contexts see
    more, but each one is seen more rarely: at a fixed amount of text the validation loss first falls with ``n``,
    then rises again as most contexts become unseen or seen only once (chapters 1 and 7 measure it).

    The counts are kept sparse: each context and each (context, next token) pair is encoded as one integer
    (the ids as digits in base ``n_V``), sorted, and looked up by binary search.
    """

    def __init__(self, n: int, vocab_size: int, context_keys, context_counts, pair_keys, pair_counts, *,
                 alpha: float = 1.0):
        n, vocab_size = _count("n", n, minimum=1), _count("vocab_size", vocab_size, minimum=1)
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not alpha > 0 or alpha == float("inf"):
            raise ValueError(f"alpha must be a positive finite number (add-α smoothing), got {alpha!r}")
        if vocab_size ** n >= 2**63:
            raise ValueError(f"n = {n} is too large for vocab_size = {vocab_size}: the n-gram keys overflow int64")
        self.n, self.vocab_size, self.alpha = n, vocab_size, float(alpha)
        self.context_keys, self.context_counts = context_keys, context_counts
        self.pair_keys, self.pair_counts = pair_keys, pair_counts

    @staticmethod
    def _keys(ids: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
        """Integer code of every window of ``n`` consecutive ids (first id most significant)."""
        keys = torch.zeros(len(ids) - n + 1, dtype=torch.long)
        for j in range(n):
            keys = keys * vocab_size + ids[j:len(ids) - n + 1 + j]
        return keys

    @classmethod
    def fit(cls, ids: Sequence[int] | torch.Tensor, vocab_size: int, n: int, *, alpha: float = 1.0) -> NGramLM:
        """Count every window of ``n`` tokens of ``ids`` and of its first ``n - 1`` tokens."""
        vocab_size = _count("vocab_size", vocab_size, minimum=1)
        ids = _as_ids(ids, vocab_size)
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1 or len(ids) < n:
            raise ValueError(f"n must be an integer in [1, len(ids)] = [1, {len(ids)}], got {n!r}")
        n = int(n)
        pair_keys, pair_counts = cls._keys(ids, n, vocab_size).unique(return_counts=True)
        # count(c) = Σ_b count(c, b): sum the pair counts of each context (pair keys are sorted, so contexts are too)
        context_of_pair = pair_keys // vocab_size
        context_keys, inverse = context_of_pair.unique_consecutive(return_inverse=True)
        context_counts = torch.zeros(len(context_keys), dtype=torch.long).index_add_(0, inverse, pair_counts)
        return cls(n, vocab_size, context_keys, context_counts, pair_keys, pair_counts, alpha=alpha)

    @classmethod
    def fit_orders(cls, ids: Sequence[int] | torch.Tensor, vocab_size: int, orders, *,
                   alpha: float = 1.0) -> dict[int, NGramLM]:
        """``{n: NGramLM.fit(ids, vocab_size, n, alpha=alpha) for n in orders}``, with one sort instead of one per n.

        The windows of the largest order are sorted once; dropping the last ``k`` tokens of every sorted key keeps
        the order, so each smaller order's counts are one pass over the sorted keys plus the few windows near the
        end of ``ids`` that the longest windows do not reach.
        """
        vocab_size = _count("vocab_size", vocab_size, minimum=1)
        ids = _as_ids(ids, vocab_size)
        orders = list(orders)
        if not orders:
            raise ValueError("orders must hold at least one n")
        for n in orders:
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1 or len(ids) < n:
                raise ValueError(f"every n in orders must be an integer in [1, len(ids)] = [1, {len(ids)}], got {n!r}")
        top = int(max(orders))
        if vocab_size ** top >= 2**63:
            raise ValueError(f"n = {top} is too large for vocab_size = {vocab_size}: the n-gram keys overflow int64")
        sorted_top = cls._keys(ids, top, vocab_size).sort().values
        models = {}
        for n in dict.fromkeys(int(n) for n in orders):
            keys, counts = (sorted_top // vocab_size ** (top - n)).unique_consecutive(return_counts=True)
            if top > n:  # the windows of n tokens that start after the last window of top tokens
                tail_keys, tail_counts = cls._keys(ids[len(ids) - top + 1:], n, vocab_size).unique(return_counts=True)
                keys, order = torch.cat([keys, tail_keys]).sort(stable=True)
                counts = torch.cat([counts, tail_counts])[order]
                keys, inverse = keys.unique_consecutive(return_inverse=True)
                counts = torch.zeros(len(keys), dtype=torch.long).index_add_(0, inverse, counts)
            context_keys, inverse = (keys // vocab_size).unique_consecutive(return_inverse=True)
            context_counts = torch.zeros(len(context_keys), dtype=torch.long).index_add_(0, inverse, counts)
            models[n] = cls(n, vocab_size, context_keys, context_counts, keys, counts, alpha=alpha)
        return models

    @staticmethod
    def _lookup(sorted_keys: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        where = torch.searchsorted(sorted_keys, queries).clamp(max=len(sorted_keys) - 1)
        return torch.where(sorted_keys[where] == queries, counts[where], 0)

    def log_probs(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``log P(w_t | w_{t-n+1}, ..., w_{t-1})`` for every ``t >= n - 1`` (0-based) of ``ids``."""
        ids = _as_ids(ids, self.vocab_size)
        if len(ids) < self.n:
            raise ValueError(f"ids must hold at least n = {self.n} tokens, got {len(ids)}")
        pairs = self._keys(ids, self.n, self.vocab_size)
        pair = self._lookup(self.pair_keys, self.pair_counts, pairs).double()
        context = self._lookup(self.context_keys, self.context_counts, pairs // self.vocab_size).double()
        return torch.log((pair + self.alpha) / (context + self.alpha * self.vocab_size))

    def loss(self, ids: Sequence[int] | torch.Tensor) -> float:
        """Mean next-token cross-entropy (nats) over the positions that have ``n - 1`` tokens before them."""
        return float(-self.log_probs(ids).mean())

    def counted_loss(self, *, leave_one_out: bool = False) -> float:
        """Mean next-token loss (nats) on the text the model was fitted on, computed from the stored counts alone.

        Equal to ``loss(training_ids)`` but without a pass over the text: an n-gram seen ``k`` times with a
        context seen ``m`` times contributes ``-k log((k + α) / (m + α n_V))``. With ``leave_one_out=True`` each
        occurrence is instead scored by the model fitted *without* it, ``(k - 1 + α) / (m - 1 + α n_V)``: an
        estimate of the loss on new text from the training text alone, used to choose ``α``.
        """
        if not isinstance(leave_one_out, bool):
            raise TypeError(f"leave_one_out must be True or False, got {leave_one_out!r}")
        k = self.pair_counts.double()
        m = self._lookup(self.context_keys, self.context_counts, self.pair_keys // self.vocab_size).double()
        held_out = 1.0 if leave_one_out else 0.0
        log_p = torch.log((k - held_out + self.alpha) / (m - held_out + self.alpha * self.vocab_size))
        return float(-(k * log_p).sum() / k.sum())

    def with_alpha(self, alpha: float) -> NGramLM:
        """The same counts with another smoothing ``alpha`` (no recounting)."""
        return NGramLM(self.n, self.vocab_size, self.context_keys, self.context_counts, self.pair_keys,
                       self.pair_counts, alpha=alpha)
