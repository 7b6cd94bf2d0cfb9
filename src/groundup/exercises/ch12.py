"""Checkers for chapter 12 (from our GPT to GPT-2 and LLaMA): splitting GPT-2's fused ``c_attn``, counting GPT-2's
parameters, and the permutation between the two pairings of rotary embeddings.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from groundup.exercises.checking import (
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    run_checks,
)
from groundup.positional import RotaryEmbedding

__all__ = ["check_split_c_attn", "check_gpt2_parameter_count", "check_rotary_permutation"]


# ---- Exercise 12.1 -----------------------------------------------------------------------------------------


def check_split_c_attn(fn: Callable) -> Verdict:
    """Exercise 12.1: ``fn(weight, bias) -> (W_q, W_k, W_v, b_q, b_k, b_v)``: GPT-2's fused ``c_attn`` (a
    ``Conv1D`` with ``weight`` of shape ``(d, 3d)`` and ``bias`` of shape ``(3d,)``, computing ``x @ weight + bias``)
    split into three ``nn.Linear``-style ``(d, d)`` weights (``x @ W.T``) and their biases."""

    def checks():
        g = torch.Generator().manual_seed(12)
        for d in (4, 6, 12):
            weight = torch.randn(d, 3 * d, generator=g, dtype=torch.float64)
            bias = torch.randn(3 * d, generator=g, dtype=torch.float64)
            expected = [weight[:, i * d:(i + 1) * d].T.clone() for i in range(3)] + \
                       [bias[i * d:(i + 1) * d].clone() for i in range(3)]
            x = torch.randn(5, d, generator=g, dtype=torch.float64)
            fused = x @ weight + bias  # what GPT-2 computes: [q | k | v] side by side
            call = f"my_split_c_attn(weight, bias) with d = {d}"
            out = call_reader(fn, weight, bias, call=call, names=("weight", "bias"))
            expect(isinstance(out, (tuple, list)) and len(out) == 6, f"{call} returned {type(out).__name__}",
                   "Return six tensors: (W_q, W_k, W_v, b_q, b_k, b_v).")
            names = ("W_q", "W_k", "W_v", "b_q", "b_k", "b_v")
            got = [expect_tensor(t, f"{call}: {name}") for t, name in zip(out, names)]
            for i, name in enumerate(names[:3]):
                w = got[i]
                if w.shape == (d, d) and torch.allclose(w.to(torch.float64), expected[i].T):
                    raise Mismatch(f"{call}: {name} is the transpose of what nn.Linear needs",
                                   "Conv1D computes x @ weight, nn.Linear computes x @ W.T: transpose each block.")
                expect_close(w, expected[i], f"{call}: {name}",
                             "Columns 0..d-1 of weight produce q, d..2d-1 produce k, 2d..3d-1 produce v; "
                             "nn.Linear stores (out, in), the transpose of a Conv1D block.", rtol=0, atol=0)
            for i, name in enumerate(names[3:]):
                expect_close(got[3 + i], expected[3 + i], f"{call}: {name}",
                             "The bias splits into the same three slices as the columns.", rtol=0, atol=0)
            q = x @ got[0].T.to(torch.float64) + got[3]
            expect_close(q, fused[:, :d], f"{call}: x @ W_q.T + b_q against GPT-2's q", rtol=1e-12, atol=1e-12)

    return run_checks("Exercise 12.1 (splitting c_attn)", checks,
                      "Your W_q, W_k, W_v and biases reproduce GPT-2's fused projection for d = 4, 6 and 12.")


# ---- Exercise 12.2 -----------------------------------------------------------------------------------------


def gpt2_parameters(n_layers: int, d_model: int, vocab_size: int, context_length: int) -> int:
    """GPT-2's parameter count: tied embedding, learned positions, biases everywhere, d_FFN = 4 d_M."""
    d = d_model
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab_size * d + context_length * d + n_layers * block + 2 * d


def check_gpt2_parameter_count(fn: Callable) -> Verdict:
    """Exercise 12.2: ``fn(n_layers, d_model, vocab_size, context_length) -> int``, GPT-2's parameter count."""

    def checks():
        cases = [(12, 768, 50257, 1024), (24, 1024, 50257, 1024), (36, 1280, 50257, 1024), (48, 1600, 50257, 1024),
                 (1, 4, 10, 8), (2, 8, 65, 16)]
        for n_layers, d, vocab, context in cases:
            expected = gpt2_parameters(n_layers, d, vocab, context)
            call = f"my_gpt2_parameter_count({n_layers}, {d}, {vocab}, {context})"
            got = expect_number(call_reader(fn, n_layers, d, vocab, context, call=call), call,
                                "Return the number of parameters as an int.")
            untied = expected + vocab * d
            hints = {untied: "GPT-2 ties the unembedding U to W_E: count that matrix once.",
                     expected - context * d: "Count the learned positional table (context_length x d_model) too.",
                     expected - 2 * d: "Count the final LayerNorm's gamma and beta (2 d_model).",
                     expected - n_layers * 13 * d - 2 * d: "Count the biases and the LayerNorms' gamma and beta."}
            expect_close(got, expected, call, hints.get(got, "Per block: two LayerNorms (2 d each), c_attn "
                         "(3 d^2 + 3 d), attention c_proj (d^2 + d), c_fc (4 d^2 + 4 d), mlp c_proj (4 d^2 + d)."),
                         rtol=0, atol=0.5)

    return run_checks("Exercise 12.2 (GPT-2's parameter count)", checks,
                      "Right for GPT-2 small (124,439,808), medium, large and XL, and for two tiny shapes.")


# ---- Exercise 12.3 -----------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, t: int, half: bool) -> torch.Tensor:
    """Rotary embedding of one vector at position t: interleaved pairs (2i, 2i+1) or halves (i, i + d/2)."""
    rotary = RotaryEmbedding(x.shape[-1], pairing="half" if half else "interleaved")
    return rotary.apply_rotary(x[None], torch.tensor([t]))[0]


def check_rotary_permutation(fn: Callable) -> Verdict:
    """Exercise 12.3: ``fn(d_head) -> perm`` (a list of d_head ints) with
    ``rope_interleaved(x[perm], t) == rope_half(x, t)[perm]`` for every vector x and position t."""

    def checks():
        g = torch.Generator().manual_seed(3)
        for d in (2, 4, 8, 16):
            expected = [j for i in range(d // 2) for j in (i, i + d // 2)]
            call = f"my_rotary_permutation({d})"
            perm = call_reader(fn, d, call=call)
            if isinstance(perm, torch.Tensor):
                perm = perm.tolist()
            expect(isinstance(perm, (list, tuple)) and len(perm) == d and all(
                isinstance(i, int) and not isinstance(i, bool) for i in perm),
                f"{call} returned {type(perm).__name__}", f"Return a list of {d} ints.")
            expect(sorted(perm) == list(range(d)), f"{call} = {list(perm)} is not a permutation of 0..{d - 1}",
                   "Every index must appear exactly once.")
            x = torch.randn(d, generator=g, dtype=torch.float64)
            for t in (0, 1, 7):
                lhs, rhs = _rope(x[list(perm)], t, half=False), _rope(x, t, half=True)[list(perm)]
                if not torch.allclose(lhs, rhs, rtol=1e-12, atol=1e-12):
                    raise Mismatch(f"{call} = {list(perm)}: rotating x[perm] with interleaved pairs differs from "
                                   f"permuting the rotate-half result at position t = {t}",
                                   "Rotate-half pairs dimension i with i + d/2 at frequency i; interleaved pairs "
                                   "2i with 2i + 1. So position 2i must take i and position 2i + 1 must take i + d/2."
                                   if perm != expected else "")

    return run_checks("Exercise 12.3 (rotate-half to interleaved)", checks,
                      "Your permutation turns LLaMA's rotate-half pairing into the book's interleaved one.")
