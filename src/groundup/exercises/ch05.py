"""Checkers for chapter 5 (attention): attention from scratch, padding masks, splitting heads, counting parameters.

Expected values are computed before the reader's function runs; it is called through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs, so `q /= math.sqrt(d)` is reported as an
in-place change, never judged on changed inputs; answer types checked), and a float32 answer is compared at a
float32 tolerance (hint code compares in float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from groundup import attention
from groundup.exercises.checking import (
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    run_checks,
)

__all__ = ["check_attention", "check_padding_mask", "check_split_heads", "check_mha_parameters"]

_ATTENTION = (attention.scaled_dot_product_attention, attention.attention_weights)  # the package's own



def check_attention(fn: Callable) -> Verdict:
    """Exercise 5.1: ``fn(q, k, v, mask=None)`` returns ``(out, weights)`` of masked scaled dot-product attention."""

    def checks():
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(2, n, 16, generator=g, dtype=torch.float64) for n in (4, 6, 6))
        mask = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)
        scores = q @ k.transpose(-2, -1)
        unscaled = torch.softmax(scores, dim=-1)
        over_d_k = torch.softmax(scores / 16.0, dim=-1)  # the common slip: dividing by d_k instead of sqrt(d_k)
        expected_weights = torch.softmax(scores / 4.0, dim=-1)
        expected_out = F.scaled_dot_product_attention(q, k, v)
        expected_masked_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        names = ("q", "k", "v")

        def attend(call, **kwargs):
            got = call_reader(fn, q, k, v, call=call, names=names, returns=tuple, expected="a pair (out, weights)",
                              **kwargs, forbid=_ATTENTION)
            expect(len(got) == 2, f"{call} returned {len(got)} values", "Return a pair (out, weights).")
            out = expect_tensor(got[0], f"{call}[0] (out)")
            weights = expect_tensor(got[1], f"{call}[1] (weights)")
            return out, weights

        out, weights = attend("attention(q, k, v)")
        expect(tuple(weights.shape) == (2, 4, 6), f"weights have shape {tuple(weights.shape)}, expected (2, 4, 6)",
               "The weights are (..., n_q, n_k): q @ k.transpose(-2, -1).")
        if torch.allclose(weights.detach().double(), unscaled, atol=1e-5):
            expect(False, "the weights equal softmax(q kᵀ) without the scaling",
                   "Divide the scores by sqrt(d_k) = sqrt(q.shape[-1]) before the softmax (equation 5.4).")
        if torch.allclose(weights.detach().double(), over_d_k, atol=1e-5):
            expect(False, "the weights equal softmax(q kᵀ / d_k): the scores were divided by d_k = 16, not by "
                   "sqrt(d_k) = 4",
                   "Scale by 1/sqrt(d_k) (math.sqrt(q.shape[-1])), not 1/d_k: sqrt(d_k) is what brings the scores' "
                   "variance d_k back to 1 (equation 5.8).")
        expect_close(weights.sum(-1), torch.ones(2, 4), "the sums of each query's weights over the keys",
                     "Take the softmax over the keys, the last dimension (dim=-1).")
        expect_close(weights, expected_weights, "weights for q, k of shape (2, 4|6, 16)",
                     "weights = softmax(q @ k.transpose(-2, -1) / sqrt(d_k), dim=-1).")
        expect_close(out, expected_out, "out compared with F.scaled_dot_product_attention", "out = weights @ v.")
        out, weights = attend("attention(q, k, v, mask=mask)", mask=mask)
        expect(tuple(weights.shape) == (2, 4, 6), f"with a mask, weights have shape {tuple(weights.shape)}, "
               "expected (2, 4, 6)", "The mask broadcasts against the scores; the weights keep their shape.")
        expect(bool((weights[:, ~mask] == 0).all()), "with a mask, some masked weights are not exactly 0",
               "Fill the masked scores with float('-inf') BEFORE the softmax (scores.masked_fill(~mask, -inf)).")
        expect_close(weights.sum(-1), torch.ones(2, 4), "with a mask, the sums of each query's weights",
                     "Mask before normalising: zeroing weights after the softmax leaves rows that sum to less "
                     "than 1.")
        expect_close(out, expected_masked_out,
                     "out with a mask, compared with F.scaled_dot_product_attention(..., attn_mask=mask)",
                     "mask is True where a query MAY attend; fill the scores where mask is False.")

    return run_checks("Exercise 5.1 (attention from scratch)", checks,
                      "It agrees with F.scaled_dot_product_attention, with and without a mask.")


def check_padding_mask(fn: Callable) -> Verdict:
    """Exercise 5.2: ``fn(lengths, n)`` returns the bool padding mask of shape ``(batch, 1, 1, n)``."""

    def checks():
        expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
        got = call_reader(fn, torch.tensor([3, 5, 1]), 5, call="padding_mask(tensor([3, 5, 1]), 5)",
                          names=("lengths", "n"), returns=torch.Tensor)
        expect(got.dtype == torch.bool, f"padding_mask returned dtype {got.dtype}",
               "Return a bool tensor: True where the key is a real token (may be attended to).")
        expect(tuple(got.shape) == (3, 1, 1, 5), f"padding_mask(tensor([3, 5, 1]), 5) has shape {tuple(got.shape)}",
               "Shape (batch, 1, 1, n), so it broadcasts over heads and queries: mask[:, None, None, :].")
        if torch.equal(got[:, 0, 0], ~expected):
            expect(False, "padding_mask is True at the padding positions",
                   "In this book True means 'may attend': True for positions j < length, False for padding.")
        expect(torch.equal(got[:, 0, 0], expected),
               f"padding_mask(tensor([3, 5, 1]), 5)[:, 0, 0] is {got[:, 0, 0].int().tolist()}",
               "Position j of sequence b is real when j < lengths[b]: torch.arange(n) < lengths[:, None].")
        got = call_reader(fn, torch.tensor([2]), 4, call="padding_mask(tensor([2]), 4)", names=("lengths", "n"),
                          returns=torch.Tensor)
        expect(tuple(got.shape) == (1, 1, 1, 4), "padding_mask(tensor([2]), 4) has the wrong "
               "shape", "Use n for the last dimension, not max(lengths).")

    return run_checks("Exercise 5.2 (padding mask)", checks, "Padding tokens now get attention weight exactly 0.")


def check_split_heads(fn: Callable) -> Verdict:
    """Exercise 5.3: ``fn(x, n_heads)`` maps ``(batch, seq, d_model)`` to ``(batch, n_heads, seq, d_head)``."""

    def checks():
        x = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
        expected = x.view(2, 3, 2, 4).transpose(1, 2)
        naive = x.view(2, 2, 3, 4)
        y = torch.randn(1, 5, 12)
        expected_y = y.view(1, 5, 3, 4).transpose(1, 2)
        names = ("x", "n_heads")
        got = call_reader(fn, x, 2, call="split_heads(x of shape (2, 3, 8), 2)", names=names, returns=torch.Tensor)
        expect(tuple(got.shape) == (2, 2, 3, 4), f"split_heads(x of shape (2, 3, 8), 2) has shape "
               f"{tuple(got.shape)}, expected (2, 2, 3, 4)", "The result is (batch, n_heads, seq, d_head).")
        if torch.equal(got, naive):
            expect(False, "split_heads reshaped x straight to (batch, n_heads, seq, d_head)",
                   "That mixes positions: a head's features are a slice of each position's vector. View as "
                   "(batch, seq, n_heads, d_head) first, then transpose(1, 2).")
        expect(torch.equal(got, expected), "split_heads(x, 2)[b, h, t] is not x[b, t, 4h:4h+4]",
               "Head h owns features h*d_head to (h+1)*d_head of every position: view, then transpose(1, 2).")
        got = call_reader(fn, y, 3, call="split_heads(y of shape (1, 5, 12), 3)", names=names, returns=torch.Tensor)
        expect(torch.equal(got, expected_y), "split_heads(y of shape (1, 5, 12), 3) is wrong",
               "d_head = d_model // n_heads; do not hard-code the sizes.")

    return run_checks("Exercise 5.3 (splitting into heads)", checks,
                      "Head h sees features h*d_head:(h+1)*d_head of every position.")


def check_mha_parameters(fn: Callable) -> Verdict:
    """Exercise 5.4: ``fn(d_model, n_heads, d_head)`` counts MultiHeadAttention's parameters (with biases)."""

    def expected(d, h, dh):
        inner = h * dh
        return 3 * (d * inner + inner) + inner * d + d

    def checks():
        for d, h, dh in [(384, 6, 64), (512, 8, 64), (10, 3, 5), (768, 12, 32)]:
            got = expect_number(call_reader(fn, d, h, dh, call=f"mha_parameters({d}, {h}, {dh})"),
                                f"mha_parameters({d}, {h}, {dh})")
            hint = ("W_q, W_k, W_v each map d_model -> n_heads*d_head (weights plus a bias of n_heads*d_head); "
                    "W_o maps n_heads*d_head -> d_model (plus a bias of d_model).")
            if isinstance(got, (int, float)) and got == expected(d, h, dh) - 3 * h * dh - d:
                hint = "Count the biases too: one per output of each of the four projections."
            expect_close(got, expected(d, h, dh), f"mha_parameters({d}, {h}, {dh})", hint, rtol=0, atol=0.5)

    return run_checks("Exercise 5.4 (counting parameters)", checks,
                      "With d_head = d_model / n_heads the count is 4 d_M² + 4 d_M, whatever n_heads is.")

