"""Checkers for chapter 10 (the encoder–decoder): the shifted decoder input, the decoder's self-attention mask.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), checks the type of what comes back, and
explains the typical mistakes in its hint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from groundup.exercises.checking import Mismatch, Verdict, call_reader, expect, expect_tensor, run_checks
from groundup.seq2seq import collate

__all__ = ["check_decoder_inputs", "check_decoder_mask"]

_CASES = [
    ([[3, 4, 5], [6]], 0, 1, 2),
    ([[7, 3, 9, 4, 8, 6], [5, 5], [9, 3, 4]], 0, 1, 2),
    ([[4, 5]], 0, 1, 2),
    ([[10, 11], [12, 13, 14]], 3, 4, 5),  # other special ids: nothing may be hard-coded
]


def _shape_hint(got: torch.Tensor, want: torch.Tensor, name: str) -> str:
    if got.shape[1] == want.shape[1] - 1:
        return (f"{name} is one position too short: the decoder input is [start] + y and the targets y + [end], "
                "both one longer than y.")
    return f"{name} has as many rows as targets and one column more than the longest target."


def check_decoder_inputs(fn: Callable) -> Verdict:
    """Exercise 10.1: ``fn(targets, pad_id, start_id, end_id) -> (tgt_in, tgt_out)``: shifted and padded."""

    def checks():
        expected = [collate([[1]] * len(seqs), seqs, pad_id=p, start_id=s, end_id=e)[1:] for seqs, p, s, e in _CASES]
        for (seqs, p, s, e), (want_in, want_out) in zip(_CASES, expected):
            call = f"my_decoder_inputs({seqs}, pad_id={p}, start_id={s}, end_id={e})"
            out = call_reader(fn, seqs, p, s, e, call=call, names=("targets", "pad_id", "start_id", "end_id"),
                              forbid=(collate,))
            expect(isinstance(out, tuple) and len(out) == 2, f"{call} returned a {type(out).__name__}",
                   "Return a pair of tensors: (decoder input, targets).")
            got_in, got_out = (expect_tensor(t, f"{call}[{i}]") for i, t in enumerate(out))
            for got, want, name in ((got_in, want_in, "the decoder input"), (got_out, want_out, "the targets")):
                expect(got.shape == want.shape, f"{call}: {name} has shape {tuple(got.shape)}, expected "
                       f"{tuple(want.shape)}", _shape_hint(got, want, name))
            expect(not got_in.is_floating_point() and not got_out.is_floating_point(),
                   f"{call} returned {got_in.dtype} / {got_out.dtype} tensors", "Token ids are integers: "
                   "use dtype=torch.long.")
            if torch.equal(got_in, want_out) and torch.equal(got_out, want_in):
                raise Mismatch(f"{call}: the decoder input and the targets are swapped",
                               "Return (decoder input, targets): the input begins with the start token.")
            if not torch.equal(got_in, want_in):
                hint = "The decoder input is [start_id] + y, padded with pad_id after its tokens."
                if bool((got_in[:, 0] != s).any()):
                    hint = ("Every decoder input must begin with the start token: the target shifted right by one, "
                            "so that position i predicts y_i from y_<i.")
                elif bool((got_in == e).any()):
                    hint = "The end token belongs in the targets only: the decoder never reads it."
                elif not bool(((got_in == p) == (want_in == p)).all()):
                    hint = f"Pad with pad_id={p}, after the tokens of each row (right-padding)."
                raise Mismatch(f"{call}: the decoder input is {got_in.tolist()}, expected {want_in.tolist()}", hint)
            if not torch.equal(got_out, want_out):
                hint = "The targets are y + [end_id], padded with pad_id after their tokens."
                if not bool((got_out == e).any(dim=1).all()):
                    hint = "Each target row must end with the end token: it is how the model learns to stop."
                elif bool((got_out[:, 0] == s).any()):
                    hint = "The start token belongs in the decoder input only: nothing ever predicts it."
                raise Mismatch(f"{call}: the targets are {got_out.tolist()}, expected {want_out.tolist()}", hint)

    return run_checks("Exercise 10.1 (shifted decoder inputs)", checks,
                      "Position i of the decoder reads y_<i (behind the start token) and predicts y_i, the last one "
                      "the end token.")


def _reference_mask(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    n = tgt_in.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal & (tgt_in != pad_id)[:, None, None, :]


def check_decoder_mask(fn: Callable) -> Verdict:
    """Exercise 10.2: ``fn(tgt_in, pad_id)`` is the decoder's self-attention mask, ``(batch, 1, n, n)``, True = may
    attend: causal, and never to a padded position."""

    def checks():
        cases = [(torch.tensor([[1, 5, 6, 7], [1, 8, 0, 0]]), 0),
                 (torch.tensor([[1, 4, 4, 3, 3]]), 3),  # pad_id 3: not hard-coded
                 (torch.tensor([[1, 2], [1, 0], [1, 9]]), 0)]
        expected = [_reference_mask(t, p) for t, p in cases]
        for (tgt_in, pad_id), want in zip(cases, expected):
            call = f"my_decoder_mask({tgt_in.tolist()}, pad_id={pad_id})"
            got = expect_tensor(call_reader(fn, tgt_in, pad_id, call=call, names=("tgt_in", "pad_id")), call)
            got = got.reshape(want.shape) if got.numel() == want.numel() else got
            expect(got.shape == want.shape, f"{call} returned shape {tuple(got.shape)}, expected {tuple(want.shape)}",
                   "Shape (batch, 1, n, n): one n×n mask per example, broadcast over the heads.")
            expect(got.dtype == torch.bool, f"{call} returned dtype {got.dtype}",
                   "Return a bool tensor, True where a query may attend to a key.")
            if torch.equal(got, want):
                continue
            n = tgt_in.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            hint = "Combine the causal mask (key j <= query i) with 'key j is not padding'."
            if torch.equal(got, want.transpose(-1, -2)):
                hint = "Rows are queries, columns keys: query i may attend to keys j <= i (a lower triangle)."
            elif torch.equal(got, causal.expand_as(want)):
                hint = "The causal mask alone lets positions attend to padded keys: also require tgt_in[j] != pad_id."
            elif torch.equal(got, (tgt_in != pad_id)[:, None, None, :].expand_as(want)):
                hint = "Without the causal mask the decoder sees the tokens it must predict: add the lower triangle."
            elif torch.equal(got, ~want):
                hint = "True means *may attend* here (as in F.scaled_dot_product_attention), not 'masked out'."
            raise Mismatch(f"{call} returned a different mask in {int((got != want).sum())} place(s)", hint)

    return run_checks("Exercise 10.2 (the decoder's self-attention mask)", checks,
                      "Causal and padding masks combine with a logical and.")
