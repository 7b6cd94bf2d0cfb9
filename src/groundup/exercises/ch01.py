"""Checkers for chapter 1, *Language models*.

Every checker computes its expected values before it calls the reader's function, calls it through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs, in-place changes reported, the type of the
answer checked) and compares at a tolerance that fits the answer's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from groundup.exercises.checking import (
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    run_checks,
)


def check_perplexity(fn) -> Verdict:
    """Exercise 1.1: ``fn(probs)`` takes the probabilities a model gave to each actual next token
    (a list of floats) and returns the perplexity ``exp(-(1/n) Σ log p)``."""

    def checks():
        cases = [([0.25, 0.25, 0.25, 0.25], 4.0), ([0.5, 0.125], 4.0), ([1.0, 1.0, 1.0], 1.0), ([0.1], 10.0),
                 ([0.9, 0.05, 0.3, 0.6, 0.2], math.exp(-sum(map(math.log, [0.9, 0.05, 0.3, 0.6, 0.2])) / 5))]
        for probs, expected in cases:
            call = f"perplexity({probs})"
            got = expect_number(call_reader(fn, list(probs), call=call, names=("probs",)), call)
            expect_close(got, expected, f"perplexity of next-token probabilities {probs}",
                         "Perplexity is exp of the *mean* negative log-probability: average log p over the tokens, "
                         "negate it, then exponentiate.")

    return run_checks("Exercise 1.1 (perplexity)", checks, "A uniform guess over n tokens has perplexity n.")


def check_bigram_counts(fn) -> Verdict:
    """Exercise 1.2: ``fn(ids, vocab_size)`` returns ``counts[a, b]``, how often ``b`` directly follows ``a``."""

    def checks():
        expected = torch.tensor([[0, 2, 0], [0, 1, 1], [1, 0, 0]])
        call = "count_bigrams([0, 1, 1, 2, 0, 1], 3)"
        got = call_reader(fn, [0, 1, 1, 2, 0, 1], 3, call=call, names=("ids", "vocab_size"))
        expect_tensor(got, call, "Start from torch.zeros(vocab_size, vocab_size, dtype=torch.long).")
        expect(tuple(got.shape) == (3, 3), f"expected shape (3, 3) for vocab_size=3, got {tuple(got.shape)}",
               "The table has one row per current token and one column per next token.")
        if torch.equal(got.detach().long(), expected.T):
            expect(False, "your table is transposed: counts[b, a] instead of counts[a, b]",
                   "Index the row by the current token ids[t] and the column by the next token ids[t+1].")
        expect_close(got, expected, "counts for ids [0, 1, 1, 2, 0, 1]",
                     "Count each adjacent pair (ids[t], ids[t+1]) once, for t = 0 .. len(ids) - 2; "
                     "the last token has no successor (no wrap-around).")
        call = "count_bigrams([2, 2, 2, 2], 4)"
        got = expect_tensor(call_reader(fn, [2, 2, 2, 2], 4, call=call, names=("ids", "vocab_size")), call)
        expect_close(got, torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]]),
                     "counts for ids [2, 2, 2, 2] with vocab_size=4", "A sequence of n tokens has n - 1 pairs.")

    return run_checks("Exercise 1.2 (bigram counts)", checks)


def check_cross_entropy(fn) -> Verdict:
    """Exercise 1.3: ``fn(logits, targets)`` returns the mean cross-entropy (nats) of logits [N, n_V] against
    target ids [N], computed from scratch, and stays finite for large logits."""

    def checks():
        g = torch.Generator().manual_seed(1)
        logits = torch.randn(6, 5, generator=g) * 3
        targets = torch.tensor([0, 4, 2, 2, 1, 3])
        big = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 1000.0, 0.0]])
        big_targets = torch.tensor([0, 2])
        expected, expected_big = F.cross_entropy(logits, targets), F.cross_entropy(big, big_targets)
        names = ("logits", "targets")

        call = "cross_entropy(logits of shape (6, 5), targets)"
        got = expect_number(call_reader(fn, logits, targets, call=call, names=names), call,
                            "Return the mean loss, a number (a 0-dimensional tensor is fine).")
        expect_close(got, expected, "mean cross-entropy of 6 random rows of logits",
                     "Use log-softmax: logit of the target minus log Σ exp(logits) in its row, negated and "
                     "averaged over the rows (not summed).")
        call = "cross_entropy(zeros(2, 8), tensor([3, 5]))"
        got = expect_number(call_reader(fn, torch.zeros(2, 8), torch.tensor([3, 5]), call=call, names=names), call)
        expect_close(got, math.log(8), "loss of all-zero logits over 8 tokens (a uniform guess)",
                     "A uniform guess costs ln n_V.")
        call = "cross_entropy(logits of size ±1000, targets)"
        got = expect_number(call_reader(fn, big, big_targets, call=call, names=names), call)
        expect(math.isfinite(got), f"logits of size 1000 gave {got}",
               "exp(1000) overflows: subtract each row's maximum from its logits before exponentiating "
               "(the softmax does not change).")
        expect_close(got, expected_big, "loss with logits of size ±1000")

    return run_checks("Exercise 1.3 (cross-entropy from scratch)", checks)
