"""Checkers for chapter 4 (positional encoding): the sinusoidal table and its shift matrix, RoPE, ALiBi's reach.

Expected values are computed before the reader's function runs; it is called through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs, in-place changes reported, answer types
checked), and hint code compares in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from groundup.exercises.checking import Verdict, call_reader, expect, expect_close, run_checks
from groundup.positional import RotaryEmbedding, alibi_slopes, sinusoidal_encoding

__all__ = ["check_alibi_half_life", "check_apply_rotary", "check_shift_matrix", "check_sinusoidal_encoding"]

_ROTARY = (RotaryEmbedding.apply_rotary, RotaryEmbedding.forward)  # the package's own rotation



def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol, rtol=0)


def check_sinusoidal_encoding(fn: Callable) -> Verdict:
    """Exercise 4.1: ``fn(n_positions, d_model)`` returns P[k, 2i] = sin(k / 10000^(2i/d)), P[k, 2i+1] = cos(...)."""

    def checks():
        expected = sinusoidal_encoding(6, 4).double()
        got = call_reader(fn, 6, 4, call="sinusoidal(6, 4)", names=("n_positions", "d_model"), returns=torch.Tensor,
                          expected="a torch.Tensor of shape [n_positions, d_model]", forbid=(sinusoidal_encoding,))
        expect(tuple(got.shape) == (6, 4), f"sinusoidal(6, 4) has shape {tuple(got.shape)}, expected (6, 4)",
               "One row per position k = 0..n_positions-1, one column per dimension.")
        got = got.detach().double()
        hint = "Column 2i holds sin(k / 10000**(2i/d)) and column 2i+1 holds cos of the same angle; k starts at 0."
        if _close(got[:, [1, 0, 3, 2]], expected):
            hint = "You swapped sine and cosine: even columns (0, 2, ...) are sines, odd columns are cosines."
        elif _close(got, torch.cat([expected[:, 0::2], expected[:, 1::2]], dim=1)):
            hint = ("You put all sines first and all cosines after. The formula interleaves them: column 2i is a sine, "
                    "column 2i+1 the cosine of the same angle.")
        elif _close(got, sinusoidal_encoding(7, 4).double()[1:]):
            hint = "Your positions start at 1; count them from k = 0 (so row 0 is [0, 1, 0, 1])."
        else:
            k = torch.arange(6.0, dtype=torch.float64)[:, None]
            wrong = k / 10000.0 ** (torch.arange(2, dtype=torch.float64) / 4)
            alt = torch.stack([wrong.sin(), wrong.cos()], dim=-1).flatten(1)
            if _close(got, alt):
                hint = "The exponent is 2i/d with i the pair index (0, 1, ...), not i/d: frequencies are 10000^(-2i/d)."
        expect_close(got, expected, "sinusoidal(6, 4)", hint, atol=1e-5)
        k, d = 37, 16
        big = call_reader(fn, 50, d, call="sinusoidal(50, 16)", returns=torch.Tensor, forbid=(sinusoidal_encoding,))
        big = big.detach().double()
        expect(tuple(big.shape) == (50, d), f"sinusoidal(50, 16) has shape {tuple(big.shape)}",
               "Use the arguments; do not hard-code the sizes.")
        for i in (0, 3, 7):
            angle = k / 10000.0 ** (2 * i / d)
            expect_close(big[k, 2 * i:2 * i + 2], torch.tensor([math.sin(angle), math.cos(angle)]),
                         f"sinusoidal(50, 16)[{k}, {2 * i}:{2 * i + 2}] (pair i={i})", hint, atol=1e-5)

    return run_checks("Exercise 4.1 (sinusoidal table)", checks,
                      "Every row is bounded by 1 and every position gets its own pattern.")


def check_apply_rotary(fn: Callable) -> Verdict:
    """Exercise 4.3: ``fn(x, positions)`` rotates pairs (2i, 2i+1) of x (..., seq, d) by positions * 10000^(-2i/d)."""

    def checks():
        x = torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)
        positions = torch.tensor([0, 1, 2])
        g = torch.Generator().manual_seed(4)
        x4 = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
        positions4 = torch.tensor([0, 3, 4, 10, 11])
        expected4 = RotaryEmbedding(8).apply_rotary(x4, positions4)
        names = ("x", "positions")
        got = call_reader(fn, x, positions, call="rope(x, positions)", names=names, returns=torch.Tensor,
                          expected="a torch.Tensor with the same shape as x", forbid=_ROTARY)
        expect(tuple(got.shape) == (3, 2), f"rope of x with shape (3, 2) returned shape {tuple(got.shape)}",
               "The output has the same shape as x.")
        expected = torch.tensor([[1.0, 0.0], [math.cos(1), math.sin(1)], [math.cos(2), math.sin(2)]])
        hint = ("At position t the pair (x0, x1) becomes (x0 cos wt - x1 sin wt, x0 sin wt + x1 cos wt), the "
                "rotation R_t of the chapter.")
        if _close(got.detach(), expected * torch.tensor([1.0, -1.0])):
            hint = "You rotate clockwise: R_t = [[cos, -sin], [sin, cos]] sends (1, 0) to (cos wt, +sin wt)."
        expect_close(got, expected, "rope(x, positions) for d=2, x = (1, 0) at positions 0, 1, 2", hint, atol=1e-5)
        x, positions, expected = x4, positions4, expected4
        got = call_reader(fn, x, positions, call="rope(x of shape (2, 3, 5, 8), positions)", names=names,
                          returns=torch.Tensor, expected="a torch.Tensor with the same shape as x", forbid=_ROTARY)
        hint = "Pair i uses the frequency 10000**(-2i/d) and the dimensions (2i, 2i+1); positions index the seq axis."
        if got.shape == x.shape:
            # the (i, i + d/2) pairing: interleave the halves, rotate, then split them again
            paired = torch.stack([x[..., :4], x[..., 4:]], dim=-1).flatten(-2)
            other = RotaryEmbedding(8).apply_rotary(paired, positions)
            other = torch.cat([other[..., 0::2], other[..., 1::2]], dim=-1)
            if _close(got.detach(), other):
                hint = ("You paired dimension i with i + d/2. This chapter pairs neighbours (2i, 2i+1): use "
                        "x[..., 0::2] and x[..., 1::2].")
            elif _close(got.detach(), RotaryEmbedding(8).apply_rotary(x, torch.arange(5))):
                hint = "Use the given positions (here 0, 3, 4, 10, 11), not 0, 1, 2, ..."
        expect_close(got, expected, "rope of x with shape (2, 3, 5, 8) at positions [0, 3, 4, 10, 11]", hint,
                     atol=1e-5)
        expect_close(got.norm(dim=-1), x.norm(dim=-1), "the norms of the rotated vectors",
                     "A rotation preserves lengths.", atol=1e-5)

    return run_checks("Exercise 4.3 (rotary embedding)", checks,
                      "Now <R_t q, R_i k> depends only on i - t.")


def check_shift_matrix(fn: Callable) -> Verdict:
    """Exercise 4.2: ``fn(delta, d_model)`` returns M with P(k + delta) = M P(k) for every k (sinusoidal P)."""

    def checks():
        got = call_reader(fn, 3, 4, call="shift_matrix(3, 4)", names=("delta", "d_model"), returns=torch.Tensor,
                          expected="a torch.Tensor of shape [d_model, d_model]")
        expect(tuple(got.shape) == (4, 4), f"shift_matrix(3, 4) has shape {tuple(got.shape)}, expected (4, 4)",
               "M maps one row of the table (d_model numbers) to another: shape [d_model, d_model].")
        for delta, d in ((3, 4), (7, 8), (1, 16), (0, 6)):
            P = sinusoidal_encoding(40 + delta, d).double()
            M = call_reader(fn, delta, d, call=f"shift_matrix({delta}, {d})", names=("delta", "d_model"),
                            returns=torch.Tensor).detach().double()
            expect(tuple(M.shape) == (d, d), f"shift_matrix({delta}, {d}) has shape {tuple(M.shape)}",
                   "Use the arguments: shape [d_model, d_model].")
            moved = P[:40] @ M.T  # row k becomes M P(k)
            hint = ("Pair i needs the 2x2 block that sends (sin a, cos a) to (sin(a + b), cos(a + b)) with "
                    "b = delta / 10000**(2i/d): use the angle-addition formulas. All other entries are 0.")
            if _close(P[:40] @ M, P[delta:40 + delta], atol=1e-5):
                hint = ("Your M is transposed, so it shifts backwards to P(k - delta): M_delta P(k) must equal "
                        "P(k + delta), so row 2i of M is (cos b, sin b) and row 2i+1 is (-sin b, cos b).")
            expect_close(moved, P[delta:40 + delta], f"shift_matrix({delta}, {d}) applied to P(k), k = 0..39, "
                         f"compared with P(k + {delta})", hint, atol=1e-5)

    return run_checks("Exercise 4.2 (sinusoidal shift matrix)", checks,
                      "The same M works at every position k: a shift of the position is a rotation.")


def check_alibi_half_life(fn: Callable) -> Verdict:
    """Exercise 4.4: ``fn(n_heads)`` returns, per head, the distance at which ALiBi alone halves the weight."""

    def checks():
        for n_heads in (8, 4, 12, 1):
            slopes = alibi_slopes(n_heads).double()
            expected = math.log(2) / slopes
            got = call_reader(fn, n_heads, call=f"half_life({n_heads})", names=("n_heads",))
            try:
                if isinstance(got, (str, bytes)) or got is None:
                    raise TypeError
                got = torch.as_tensor(got, dtype=torch.float64).flatten()
            except (TypeError, ValueError, RuntimeError):
                expect(False, f"half_life({n_heads}) returned a {type(got).__name__}, "
                       "expected a list or 1-D tensor of numbers",
                       "Return a list or a 1-D tensor of n_heads numbers.")
            expect(got.numel() == n_heads, f"half_life({n_heads}) has {got.numel()} entries, expected {n_heads}",
                   "One distance per head.")
            slopes = alibi_slopes(n_heads).double()
            expected = math.log(2) / slopes
            h = torch.arange(n_heads, dtype=torch.float64)
            hint = ("The weight is proportional to exp(s - m_h * distance); it halves when m_h * distance = ln 2. "
                    "Head h = 1..n_heads has slope m_h = 2**(-8h/n_heads) when n_heads is a power of two.")
            if _close(got, 1 / slopes, atol=1e-6):
                hint = "1/m_h is where the bias reaches -1 (weight / e). For a factor 1/2 you need ln 2 / m_h."
            elif _close(got, math.log(2) * 2.0 ** (8 * h / n_heads), atol=1e-6):
                hint = "Count the heads from h = 1, not 0: the first slope is 2**(-8/n_heads), not 1."
            elif _close(got, expected.flip(0), atol=1e-6):
                hint = "Your heads are in the reverse order: head 1 has the steepest slope, so the shortest reach."
            elif _close(got, math.log(2) * slopes, atol=1e-6):
                hint = "You multiplied by the slope; the distance is ln 2 divided by the slope."
            elif n_heads & (n_heads - 1) and _close(got, math.log(2) * 2.0 ** (8 * (h + 1) / n_heads), atol=1e-6):
                hint = (f"{n_heads} is not a power of two, so the slopes are not 2**(-8h/n_heads): take the 8 "
                        "slopes of 8 heads, then every other slope (the 1st, 3rd, ...) of the 16-head sequence, "
                        "as the chapter's ALiBi section does (groundup.positional.alibi_slopes).")
            expect_close(got, expected, f"half_life({n_heads})", hint, rtol=1e-6, atol=1e-9)

    return run_checks("Exercise 4.4 (ALiBi's reach)", checks,
                      "Steep heads look a few tokens back, shallow heads a few hundred.")
