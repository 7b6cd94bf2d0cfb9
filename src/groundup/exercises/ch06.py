"""Checkers for chapter 6 (the transformer block): LayerNorm, RMSNorm, a Pre-LN block, counting parameters, SwiGLU.

Expected values are computed before the reader's function runs; it is called through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs and of the block, so zeroing the block's
parameters is reported, never judged against changed weights; answer types checked), and a float32 answer is
compared at a float32 tolerance (hint code compares in float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from groundup.exercises.checking import Verdict, call_reader, expect, expect_close, run_checks
from groundup.layers import TransformerBlock
from groundup.models import GPT, GPTConfig

__all__ = ["check_layer_norm", "check_parameter_count", "check_pre_ln_block", "check_rms_norm", "check_swiglu"]


def check_layer_norm(fn: Callable) -> Verdict:
    """Exercise 6.1: ``fn(x, weight, bias, eps)`` is LayerNorm over the last dimension, ε under the square root."""

    def checks():
        g = torch.Generator().manual_seed(6)
        x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64) * 4 + 1
        w, b = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
        x2 = torch.tensor([[1.0, 1.001, 0.999, 1.0]], dtype=torch.float64)
        ones, zeros = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        expected = F.layer_norm(x, (8,), w, b, 1e-5)
        expected2 = F.layer_norm(x2, (4,), ones, zeros, 1e-2)
        names = ("x", "weight", "bias", "eps")
        got = call_reader(fn, x, w, b, 1e-5, call="layer_norm(x, weight, bias, 1e-5)", names=names,
                          returns=torch.Tensor)
        hint = "Normalise each vector over its last dimension: (x - mean) / sqrt(var + eps), then γ ⊙ · + β."
        if got.shape == x.shape:
            got64 = got.detach().double()
            unbiased = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) * w + b
            plain = F.layer_norm(x, (8,), None, None, 1e-5)
            centred = x - x.mean(-1, keepdim=True)
            seeds = centred / (centred.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5) * w + b
            if torch.allclose(got64, seeds, atol=1e-9 if got.dtype == torch.float64 else 1e-5):
                hint = "Close: that is the seeds' σ + ε. Put eps inside the square root, sqrt(var + eps), as PyTorch."
            elif torch.allclose(got64, unbiased, atol=1e-5):
                hint = "You used the unbiased variance (1/(d-1)); LayerNorm uses 1/d: var(..., unbiased=False)."
            elif torch.allclose(got64, plain, atol=1e-5):
                hint = "You normalised but forgot the learned scale and shift: multiply by weight, add bias."
            elif torch.allclose(got64, F.layer_norm(x.transpose(-1, -2), (5,)).transpose(-1, -2) * w + b,
                                atol=1e-5):
                hint = "You normalised over the wrong dimension: the mean and variance are over the last one (dim=-1)."
        expect_close(got, expected, "layer_norm of a (3, 5, 8) batch with random γ, β (compared with "
                     "F.layer_norm)", hint, atol=1e-6)
        # A vector with tiny spread and a large eps: tells ε under the root from the seeds' σ + ε.
        got2 = call_reader(fn, x2, ones, zeros, 1e-2, call="layer_norm(x, ones, zeros, 0.01)", names=names,
                           returns=torch.Tensor)
        expect_close(got2, expected2,
                     "layer_norm([[1, 1.001, 0.999, 1]], eps=0.01), an input with tiny variance",
                     "Put eps inside the square root, sqrt(var + eps), as PyTorch does (the seeds write σ + ε).",
                     atol=1e-6)

    return run_checks("Exercise 6.1 (LayerNorm)", checks, "It matches torch.nn.functional.layer_norm.")


def check_rms_norm(fn: Callable) -> Verdict:
    """Exercise 6.2: ``fn(x, weight, eps)`` is RMSNorm: ``weight * x / sqrt(mean(x²) + eps)`` over the last dim."""

    def checks():
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 3 + 2
        w = torch.randn(6, generator=g, dtype=torch.float64)
        expected = F.rms_norm(x, (6,), w, 1e-6)
        got = call_reader(fn, x, w, 1e-6, call="rms_norm(x, weight, 1e-6)", names=("x", "weight", "eps"),
                          returns=torch.Tensor)
        hint = "Divide each vector by sqrt(mean(x**2 over the last dim) + eps), then multiply by weight."
        if got.shape == x.shape:
            got64 = got.detach().double()
            if torch.allclose(got64, F.layer_norm(x, (6,), w, None, 1e-6), atol=1e-5):
                hint = "You subtracted the mean: RMSNorm does not centre the vector, it only rescales it."
            elif torch.allclose(got64, w * x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6), atol=1e-5):
                hint = "You divided by the Euclidean norm (a sum); the RMS uses the mean of the squares."
        expect_close(got, expected, "rms_norm of a (2, 4, 6) batch (compared with "
                     "F.rms_norm)", hint, atol=1e-6)

    return run_checks("Exercise 6.2 (RMSNorm)", checks, "It matches torch.nn.functional.rms_norm.")


def _block_config(norm_position: str):
    return GPTConfig(vocab_size=10, context_length=8, d_model=16, n_layers=1, n_heads=4, d_ff=24,
                     norm_position=norm_position)


def check_pre_ln_block(fn: Callable) -> Verdict:
    """Exercise 6.3: ``fn(x, block, mask)`` computes a Pre-LN block's forward pass from the block's sub-modules."""

    def checks():
        torch.manual_seed(60)
        block = TransformerBlock(_block_config("pre")).eval()
        with torch.no_grad():  # make the norms' γ and β matter
            for norm in (block.norm_1, block.norm_2):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_(0.0, 0.3)
        x = torch.randn(2, 6, 16)
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        with torch.no_grad():
            expected = block(x, mask=mask)
            got = call_reader(fn, x, block, mask, call="pre_ln_block(x, block, mask)", names=("x", "block", "mask"),
                              returns=torch.Tensor, forbid=(TransformerBlock.forward,))
            hint = "x = x + attention(norm_1(x), mask=mask); then x = x + ffn(norm_2(x))."
            if got.shape == x.shape:
                got = got.detach().float()
                post = TransformerBlock(_block_config("post")).eval()
                post.load_state_dict(block.state_dict())
                a = x + block.attention(block.norm_1(x), mask=mask)
                if torch.allclose(got, post(x, mask=mask), atol=1e-5):
                    hint = "That is the Post-LN block (norm after adding); Pre-LN normalises what the branch reads."
                elif torch.allclose(got, block.attention(block.norm_1(x), mask=mask)
                                    + block.ffn(block.norm_2(a)), atol=1e-5):
                    hint = "The first residual connection is missing: add the attention's output to x."
                elif torch.allclose(got, block.ffn(block.norm_2(a)), atol=1e-5):
                    hint = "The second residual connection is missing: return x + ffn(norm_2(x))."
                elif torch.allclose(got, a + block.ffn(block.norm_2(x)), atol=1e-5):
                    hint = "The FFN must read the stream *after* the attention wrote to it."
                elif torch.allclose(got, x + block.attention(block.norm_1(x)) + block.ffn(block.norm_2(
                        x + block.attention(block.norm_1(x)))), atol=1e-5):
                    hint = "Pass mask=mask to the attention, or later positions leak into earlier ones."
            expect_close(got, expected, "pre_ln_block on a (2, 6, 16) batch (compared with TransformerBlock with "
                         "norm_position='pre')", hint, atol=1e-5)

    return run_checks("Exercise 6.3 (Pre-LN block)", checks, "Your block equals groundup's TransformerBlock.")


_COUNT_CASES = [
    dict(),
    dict(tie_weights=False),
    dict(norm="rmsnorm"),
    dict(norm_position="post"),
    dict(positional="sinusoidal"),
    dict(positional="rope", d_ff=100),
    dict(positional="relative", n_layers=3),
]


def check_parameter_count(fn: Callable) -> Verdict:
    """Exercise 6.4: ``fn(config)`` counts a GPT's parameters by formula, equal to ``sum(p.numel())``."""

    def checks():
        for kw in _COUNT_CASES:
            config = GPTConfig(**{**dict(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4), **kw})
            expected = sum(p.numel() for p in GPT(config).parameters())
            got = call_reader(fn, config, call="count_parameters(config)", names=("config",))
            expect(isinstance(got, int) and not isinstance(got, bool),
                   f"count_parameters returned a {type(got).__name__}, expected an int", "Return a Python int.")
            d, v, c = config.d_model, config.vocab_size, config.context_length
            diff = expected - got
            hint = ("Per block: attention 4 (d² + d), FFN 2 d d_FFN + d_FFN + d, two norms; plus the embedding, "
                    "the positional parameters, the final norm (Pre-LN only) and the unembedding (untied only).")
            if abs(diff) == v * d:
                hint = "Off by n_V d_M: with tie_weights the unembedding is the embedding matrix (count it once)."
            elif abs(diff) == c * d:
                hint = "Off by n_C d_M: only positional='learned' has a learned table of positions."
            elif abs(diff) in (d, 2 * d):
                hint = "Off by one norm: only Pre-LN has a final norm (Post-LN blocks already end with one)."
            elif abs(diff) == config.n_heads * (c + 1):
                hint = "positional='relative' learns one bias per head and offset 0..n_C (shared by all layers)."
            elif diff % config.n_layers == 0 and abs(diff) // config.n_layers in (d, 2 * d, 4 * d):
                hint = "Check the norms in each block: LayerNorm has γ and β (2 d_M), RMSNorm only γ (d_M)."
            changed = ", ".join(f"{k}={val!r}" for k, val in kw.items()) or "the defaults"
            expect(got == expected, f"for GPTConfig with {changed} (vocab_size=50, context_length=32, d_model=32, "
                   f"n_layers={config.n_layers}, n_heads=4, d_ff={config.d_ff}) you counted {got:,}, "
                   f"sum(p.numel()) is {expected:,}", hint)

    return run_checks("Exercise 6.4 (counting parameters)", checks,
                      f"Your formula matches sum(p.numel()) for all {len(_COUNT_CASES)} configurations.")


def check_swiglu(fn: Callable) -> Verdict:
    """Exercise 6.7: ``fn(x, W_gate, W_in, W_out)`` is the SwiGLU FFN ``W_out (SiLU(W_gate x) ⊙ W_in x)``.

    The weights have PyTorch's ``[out_features, in_features]`` layout (``W_gate, W_in``: ``[d_ff, d_model]``,
    ``W_out``: ``[d_model, d_ff]``); ``x`` is ``(..., d_model)``.
    """

    def checks():
        g = torch.Generator().manual_seed(16)
        d_model, d_ff = 6, 10
        x = torch.randn(2, 5, d_model, generator=g, dtype=torch.float64)
        W_gate, W_in = (torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) for _ in range(2))
        W_out = torch.randn(d_model, d_ff, generator=g, dtype=torch.float64) / 3
        gate, up = x @ W_gate.T, x @ W_in.T
        expected = (F.silu(gate) * up) @ W_out.T
        got = call_reader(fn, x, W_gate, W_in, W_out, call="swiglu(x, W_gate, W_in, W_out)",
                          names=("x", "W_gate", "W_in", "W_out"), returns=torch.Tensor)
        hint = "Compute gate = x @ W_gate.T and h = x @ W_in.T, multiply SiLU(gate) * h entry by entry, then @ W_out.T."
        if got.shape == expected.shape:
            got64 = got.detach().double()
            wrong = {
                "SiLU goes on the gate (x @ W_gate.T), not on x @ W_in.T.": (gate * F.silu(up)) @ W_out.T,
                "SiLU(z) is z·sigmoid(z), not sigmoid(z) alone (that would be GLU).": (torch.sigmoid(gate) * up)
                @ W_out.T,
                "That is a plain FFN: SwiGLU multiplies SiLU(x @ W_gate.T) by a second projection x @ W_in.T.":
                    F.silu(up) @ W_out.T,
                "Use SiLU(z) = z·sigmoid(z) on the gate (F.silu), not GELU.": (F.gelu(gate) * up) @ W_out.T,
            }
            for message, value in wrong.items():
                if torch.allclose(got64, value, atol=1e-5):
                    hint = message
                    break
        expect_close(got, expected, f"swiglu of a (2, 5, {d_model}) batch with d_ff = {d_ff} (compared with "
                     "(F.silu(x @ W_gate.T) * (x @ W_in.T)) @ W_out.T)", hint, atol=1e-6)

    return run_checks("Exercise 6.7 (SwiGLU)", checks, "It is the SwiGLU FFN of equation (6.16).")
