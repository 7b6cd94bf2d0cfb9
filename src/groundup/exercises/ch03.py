"""Checkers for chapter 3 (embeddings): one-hot vectors, the RMS initialisation, softmax, weight tying.

Expected values are computed before the reader's function runs; it is called through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs, in-place changes reported, answer types
checked), and answers are compared in float64 at a tolerance that fits their dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from groundup.exercises.checking import Verdict, call_reader, expect, expect_close, expect_number, run_checks

__all__ = ["check_one_hot", "check_rms_init", "check_softmax", "check_tying_savings"]


def check_one_hot(fn: Callable) -> Verdict:
    """Exercise 3.1: ``fn(ids, vocab_size)`` returns float one-hot vectors, shape ``[*ids.shape, vocab_size]``."""

    def checks():
        ids = torch.tensor([2, 0, 4])
        expected = torch.tensor([[0.0, 0, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
        batch = torch.tensor([[1, 1], [0, 6]])
        w = torch.arange(21.0, dtype=torch.float64).reshape(7, 3)
        expected_batch, expected_rows = torch.eye(7)[batch], w[batch]
        names = ("ids", "vocab_size")

        call = "one_hot(tensor([2, 0, 4]), 5)"
        got = call_reader(fn, ids, 5, call=call, names=names, returns=torch.Tensor)
        expect(got.is_floating_point(), f"{call} has dtype {got.dtype}",
               "Return floats (e.g. torch.zeros(..., dtype=torch.float32)) so the result can multiply W_E.")
        expect_close(got, expected, call, "Row r must have a single 1, in column ids[r], and zeros elsewhere.")
        call = "one_hot of a [2, 2] batch with vocab_size=7"
        got = call_reader(fn, batch, 7, call=call, names=names, returns=torch.Tensor)
        expect_close(got, expected_batch, call,
                     "Work for ids of any shape: the result has shape [*ids.shape, vocab_size].")
        expect_close(got.detach().double() @ w, expected_rows,
                     "one_hot(ids, 7) @ W_E compared with the lookup W_E[ids]",
                     "Each one-hot row times W_E must pick out one row of W_E.")

    return run_checks("Exercise 3.1 (one-hot vectors)", checks,
                      "Multiplying them by W_E picks out rows, exactly like W_E[ids].")


def check_rms_init(fn: Callable) -> Verdict:
    """Exercise 3.2: ``fn(vocab_size, d_model)`` returns a random ``W_E`` whose every row has RMS norm exactly 1."""

    def checks():
        torch.manual_seed(123)
        w = call_reader(fn, 500, 64, call="rms_init(500, 64)", returns=torch.Tensor)
        expect(tuple(w.shape) == (500, 64), f"rms_init(500, 64) has shape {tuple(w.shape)}, expected (500, 64)",
               "W_E has one row per token: shape [vocab_size, d_model].")
        w = w.detach().double()
        row_rms = w.pow(2).mean(dim=1).sqrt()
        col_rms = w.pow(2).mean(dim=0).sqrt()
        worst = (row_rms - 1).abs().max().item()
        hint = "Divide each row by its own RMS norm, sqrt(mean of its squares over d_model)."
        if (col_rms - 1).abs().max().item() < 1e-4 and worst > 1e-4:
            hint = "You normalised the columns (dim=0); each row (one token's vector, dim=1) must have RMS 1."
        elif abs(row_rms.mean().item() - 1 / math.sqrt(64)) < 0.05:
            hint = ("Your rows have RMS about 1/sqrt(d_model): that is the unembedding's scale. The embedding's rows "
                    "should have RMS 1.")
        expect(worst < 1e-4, f"the row RMS norms of rms_init(500, 64) range from {row_rms.min().item():.4f} "
               f"to {row_rms.max().item():.4f}, expected exactly 1", hint)
        expect(w.abs().std().item() > 1e-3 and abs(w.mean().item()) < 0.05,
               "rms_init(500, 64) has RMS-1 rows but its entries are not random numbers centred on 0",
               "Start from torch.randn(vocab_size, d_model), then rescale each row.")
        expect(torch.linalg.matrix_rank(w[:64]).item() == 64, "the rows of rms_init(500, 64) are not independent",
               "Every token needs its own random direction: draw a fresh Gaussian row for each token.")
        again = call_reader(fn, 500, 64, call="rms_init(500, 64)", returns=torch.Tensor)
        expect(again.shape != w.shape or not torch.allclose(again.detach().double(), w),
               "two calls of rms_init(500, 64) returned the same matrix",
               "Draw fresh random numbers on every call (torch.randn uses the global generator).")

    return run_checks("Exercise 3.2 (RMS initialisation)", checks,
                      "Every token's vector starts with RMS norm exactly 1.")


def check_softmax(fn: Callable) -> Verdict:
    """Exercise 3.3: ``fn(logits)`` is a numerically stable softmax over the last dimension."""

    def checks():
        g = torch.Generator().manual_seed(3)
        z = torch.randn(4, 6, generator=g, dtype=torch.float64)
        z3 = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
        big = torch.tensor([[1000.0, 1001.0, 999.0]])
        masked = torch.tensor([[0.0, float("-inf"), 1.0]])
        expected = {name: torch.softmax(x, dim=-1) for name, x in (("z", z), ("z3", z3), ("big", big),
                                                                   ("masked", masked))}

        call = "softmax of a [4, 6] tensor of random logits"
        got = call_reader(fn, z, call=call, names=("logits",), returns=torch.Tensor)
        expect_close(got, expected["z"], call,
                     "Exponentiate, then divide by the sum over the last dimension (dim=-1, keepdim=True).",
                     rtol=1e-6, atol=1e-9)
        call = "softmax of a [2, 3, 5] tensor (over the last dimension)"
        got = call_reader(fn, z3, call=call, names=("logits",), returns=torch.Tensor)
        expect_close(got, expected["z3"], call, "Normalise over dim=-1 for any number of leading dimensions.",
                     rtol=1e-6, atol=1e-9)
        call = "softmax(tensor([[1000., 1001., 999.]]))"
        out = call_reader(fn, big, call=call, names=("logits",), returns=torch.Tensor)
        expect(bool(torch.isfinite(out).all()), f"{call} gave {out.tolist()}",
               "exp(1000) overflows to inf. Subtract each row's maximum first: softmax(z - c) = softmax(z).")
        expect_close(out, expected["big"], call, "Subtract each row's maximum (keepdim=True) before exponentiating.")
        call = "softmax(tensor([[0., -inf, 1.]]))"
        got = call_reader(fn, masked, call=call, names=("logits",), returns=torch.Tensor)
        expect_close(got, expected["masked"], call, "A logit of -inf must get probability exactly 0 (exp(-inf) = 0).")

    return run_checks("Exercise 3.3 (stable softmax)", checks,
                      "Every entry is positive and each row sums to 1, even for huge logits.")


def check_tying_savings(fn: Callable) -> Verdict:
    """Exercise 3.4: ``fn(vocab_size, d_model, n_layers)`` returns ``(saved, fraction)`` for weight tying."""

    cases = [(50257, 768, 12), (32000, 1000, 4), (84, 256, 6)]

    def expected(n_v, d, n_l):
        saved = n_v * d
        return saved, saved / (2 * n_v * d + 12 * n_l * d * d)

    def checks():
        for n_v, d, n_l in cases:
            saved, fraction = expected(n_v, d, n_l)
            call = f"tying_savings({n_v}, {d}, {n_l})"
            got = call_reader(fn, n_v, d, n_l, call=call, returns=tuple, expected="a pair (saved, fraction)")
            expect(len(got) == 2, f"{call} returned {len(got)} values", "Return a pair (saved, fraction).")
            expect_close(expect_number(got[0], f"{call}[0]"), saved, f"parameters saved, {call}[0]",
                         "Tying removes the whole unembedding matrix U, which has vocab_size * d_model entries.",
                         rtol=0, atol=0.5)
            expect_close(expect_number(got[1], f"{call}[1]"), fraction, f"fraction saved, {call}[1]",
                         "Divide by the UNTIED total: embedding + unembedding (2 n_V d_M) + 12 d_M^2 per block.",
                         rtol=1e-6)

    return run_checks("Exercise 3.4 (parameters saved by tying)", checks)
