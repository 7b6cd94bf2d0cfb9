"""Checkers for chapter 14 (inside a trained transformer): finding the planted heads of a hand-built induction
model with the reader's own scores, zero-ablating one head with a forward pre-hook, and the K-composition score.

Every checker computes the expected values before it calls the reader's function (which gets copies of its
inputs), refuses the package's own solution and checks the type of what comes back. The checks of 14.1 and 14.2
draw their token sequences afresh on every call (and 14.1 shuffles its four cases), so answers remembered from an
earlier run do not pass.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch

from groundup import interpretability as interp
from groundup.exercises.checking import Mismatch, Verdict, call_reader, expect, expect_close, expect_number, run_checks
from groundup.induction import AttentionOnlyConfig, hand_built_induction_model, in_context_loss
from groundup.models import GPT

__all__ = ["check_find_induction_circuit", "check_zero_ablation", "check_k_composition", "permute_heads",
           "planted_model"]


# ---- Exercise 14.1: the planted heads --------------------------------------------------------------------------


def permute_heads(model: GPT, layer: int, order: list[int]) -> GPT:
    """Reorder the heads of block ``layer`` in place: new head ``i`` is old head ``order[i]``.

    The rows of ``W_q``, ``W_k``, ``W_v`` (one block of ``d_head`` rows per head) and the columns of ``W_o`` move
    together, so the model computes the same function (the output projection sums over heads). Needs one key/value
    head per query head. Returns ``model``.
    """
    attention = model.blocks[layer].attention
    n, d_head = attention.n_heads, attention.d_head
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0 .. {n - 1}, got {order!r}")
    if attention.n_kv_heads != n:
        raise ValueError("permute_heads needs as many key/value heads as query heads")
    index = torch.cat([torch.arange(h * d_head, (h + 1) * d_head) for h in order])
    with torch.no_grad():
        for name in ("W_q", "W_k", "W_v"):
            linear = getattr(attention, name)
            linear.weight.copy_(linear.weight[index])
            if linear.bias is not None:
                linear.bias.copy_(linear.bias[index])
        attention.W_o.weight.copy_(attention.W_o.weight[:, index])
    return model


def planted_model(vocab_size: int, context_length: int, swap_layer1: bool, swap_layer2: bool):
    """The hand-built induction model (:func:`groundup.induction.hand_built_induction_model`) with the heads of
    layer 1 and / or layer 2 swapped, and where its previous-token and induction heads then are:
    ``(model, ((0, prev_head), (1, induction_head)))``."""
    model = hand_built_induction_model(vocab_size, context_length)
    if swap_layer1:
        permute_heads(model, 0, [1, 0])
    if swap_layer2:
        permute_heads(model, 1, [1, 0])
    return model.eval(), ((0, int(swap_layer1)), (1, int(swap_layer2)))


def _permutation_repeats(n_seq: int, half: int, vocab_size: int, g: torch.Generator) -> torch.Tensor:
    """Repeated sequences whose first half has no token twice (what the hand-built model is exact on)."""
    first = torch.stack([torch.randperm(vocab_size, generator=g)[:half] for _ in range(n_seq)])
    return torch.cat([first, first], dim=1)


def _fresh_seed() -> int:
    """A seed that differs from call to call (the operating system's randomness, not torch's seeded state)."""
    return int.from_bytes(os.urandom(4), "little")


def _as_pair(value, call: str, what: str) -> tuple[int, int]:
    expect(isinstance(value, (tuple, list)) and len(value) == 2, f"{call} returned {value!r} as the {what}",
           "Give each head as a pair (layer, head) of ints, counting from 0 as the package does.")
    pair = []
    for x in value:
        if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
            x = int(x)
        expect(isinstance(x, int) and not isinstance(x, bool), f"{call} returned {value!r} as the {what}",
               "Give each head as a pair (layer, head) of ints, e.g. (0, 1); `int(tensor)` turns an argmax into one.")
        pair.append(x)
    return pair[0], pair[1]


def check_find_induction_circuit(fn: Callable) -> Verdict:
    """Exercise 14.1: ``fn(model, tokens) -> ((prev_layer, prev_head), (ind_layer, ind_head))``: the
    previous-token head and the induction head of a two-layer model, found from its attention patterns on the
    repeated sequences ``tokens`` with the reader's own scores (the package's ``previous_token_scores`` and
    ``induction_scores`` are refused, and so are the weight scores ``composition_scores``, ``copying_scores``,
    ``copying_ranks``, ``ov_eigenvalue_scores``, ``head_matrices`` and the interventions ``ablate_heads``,
    ``remove_from_inputs``, ``direct_logit_attribution``: the attention patterns are the evidence). The models
    are the hand-built induction model with its heads in four different orders and two sizes, in a shuffled
    order, on freshly drawn sequences; its decoy heads have larger weights than the planted ones, so guessing
    from the size of the weights fails."""
    forbid = (interp.previous_token_scores, interp.induction_scores, interp.composition_scores,
              interp.copying_scores, interp.copying_ranks, interp.ov_eigenvalue_scores, interp.head_matrices,
              interp.direct_logit_attribution, interp.ablate_heads.__wrapped__, interp.remove_from_inputs.__wrapped__)

    def checks():
        seed = _fresh_seed()
        g = torch.Generator().manual_seed(seed)
        cases = [(16, 16, False, False), (16, 16, True, False), (24, 20, False, True), (24, 20, True, True)]
        random.Random(seed).shuffle(cases)
        for vocab, context, swap1, swap2 in cases:
            model, (prev, induction) = planted_model(vocab, context, swap1, swap2)
            tokens = _permutation_repeats(8, context // 2, vocab, g)
            order = "swapped" if swap1 or swap2 else "in order"
            call = f"my_find_induction_circuit(model, tokens) (vocabulary {vocab}, heads {order})"
            out = call_reader(fn, model, tokens, call=call, names=("model", "tokens"), forbid=forbid)
            expect(isinstance(out, (tuple, list)) and len(out) == 2,
                   f"{call} returned {type(out).__name__}, expected a pair of heads",
                   "Return ((layer, head) of the previous-token head, (layer, head) of the induction head).")
            got_prev, got_ind = _as_pair(out[0], call, "previous-token head"), _as_pair(out[1], call, "induction head")
            if (got_prev, got_ind) == (induction, prev):
                raise Mismatch(f"{call} returned the two heads the wrong way round",
                               "The previous-token head comes first, the induction head second.")
            expect(got_prev == prev, f"{call} says the previous-token head is {got_prev}; it is {prev}",
                   "Score every head by its mean attention from position i to i - 1 (equation 14.3), over the batch "
                   "and the positions 1 .. n-1, and take the largest. Do not assume it is head 0.")
            expect(got_ind == induction, f"{call} says the induction head is {got_ind}; it is {induction}",
                   "With H = half the length, an induction head attends from i to i - H + 1 (equation 14.4): average "
                   "pattern[b, h, i, i - H + 1] over i = H .. 2H-1 and take the largest.")

    return run_checks("Exercise 14.1 (finding the planted heads)", checks,
                      "Your scores found the previous-token head and the induction head in all four head orders.")


# ---- Exercise 14.2: zero ablation with a hook -------------------------------------------------------------------


def _random_model(seed: int) -> GPT:
    """A random two-layer, four-head attention-only model whose attention weights are scaled up tenfold, so that
    removing any one head changes the in-context loss by 1e-3 or more (at the usual initialisation the heads
    write so little that their ablations differ by about 1e-5), with random non-zero biases (so that zeroing a
    head's rows of ``W_v`` is not the same as zeroing its output: the value bias would still pass)."""
    torch.manual_seed(seed)
    config = AttentionOnlyConfig(vocab_size=16, context_length=16, d_model=32, n_layers=2, n_heads=4,
                                 positional="rope", tie_weights=False, bias=True)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight")):
                p.mul_(10.0)
            elif name.endswith(("W_q.bias", "W_k.bias", "W_v.bias", "W_o.bias")):
                p.normal_(0.0, 1.0)
    return model


def _hooks_left(model: GPT) -> int:
    """How many forward hooks and pre-hooks are registered on the modules of ``model``."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _zero_loss(model: GPT, tokens: torch.Tensor, heads) -> float:
    with interp.ablate_heads(model, heads):
        return in_context_loss(model, tokens)


def check_zero_ablation(fn: Callable) -> Verdict:
    """Exercise 14.2: ``fn(model, tokens, layer, head) -> float``: the in-context loss
    (:func:`groundup.induction.in_context_loss`) on ``tokens`` with head ``head`` of block ``layer`` zero-ablated,
    by the reader's own code (the package's ``ablate_heads`` is refused), leaving the model as it was: no hook left
    registered, the weights unchanged. A forward pre-hook on ``W_o`` is the easiest way; any zero ablation that
    gives the same loss (a forward hook that subtracts the head's part, a zeroed copy of the model) is accepted."""
    forbid = (interp.ablate_heads.__wrapped__,)  # the generator behind the context manager: every call trips

    def and_hooks_left(model, tokens, layer, head):  # runs in the reader's thread, on the reader's copy
        return fn(model, tokens, layer, head), _hooks_left(model)

    def checks():
        g = torch.Generator().manual_seed(_fresh_seed())
        hand, _ = planted_model(16, 16, False, False)
        models = [("the hand-built model", hand, [(0, 0), (1, 0), (1, 1)], _permutation_repeats(8, 8, 16, g)),
                  ("a random 4-head model", _random_model(14), [(0, 2), (1, 3)],
                   _permutation_repeats(8, 8, 16, g))]
        for label, model, heads, tokens in models:
            n_heads = model.config.n_heads
            for layer, head in heads:
                expected = _zero_loss(model, tokens, [(layer, head)])
                wrong = {in_context_loss(model, tokens): "The loss did not change: does your pre-hook return the "
                         "modified input (a tuple), is it registered on blocks[layer].attention.W_o, and does it zero "
                         "the columns of head `head` (h * d_head .. (h + 1) * d_head - 1 for head h)?",
                         _zero_loss(model, tokens, [(layer, h) for h in range(n_heads)]):
                         "That is the loss with every head of the layer ablated: zero only the columns "
                         "head * d_head .. (head + 1) * d_head - 1 of W_o's input."}
                if head + 1 < n_heads:
                    wrong.setdefault(_zero_loss(model, tokens, [(layer, head + 1)]),
                                     "That is the next head's ablation: head h owns W_o's input "
                                     "columns h * d_head .. (h + 1) * d_head - 1.")
                call = f"my_zero_ablated_loss(model, tokens, {layer}, {head}) on {label}"
                got, left = call_reader(and_hooks_left, model, tokens, layer, head, call=call,
                                        names=("model", "tokens", "layer", "head"), forbid=forbid)
                got = expect_number(got, call, "Return the loss as a float (float(loss)).")
                expect(left == 0, f"{call} left {left} hook(s) registered on the model",
                       "Remove the hook before returning: keep the handle that register_forward_pre_hook returns "
                       "and call handle.remove() in a `finally:` block, so the model is as it was.")
                for value, hint in wrong.items():
                    if abs(got - value) < 1e-5 and abs(value - expected) > 1e-4:
                        raise Mismatch(f"{call} returned {got:.4f}; the loss with that head ablated is "
                                       f"{expected:.4f}", hint)
                expect_close(got, expected, call, "Zero the head's slice of W_o's input in a forward pre-hook, "
                             "compute in_context_loss(model, tokens), then remove the hook.", rtol=1e-4, atol=1e-5)

    return run_checks("Exercise 14.2 (zero ablation with a hook)", checks,
                      "Your hook removes exactly one head's contribution, on two models.")


# ---- Exercise 14.3: K-composition -------------------------------------------------------------------------------


def k_composition(w_qk: torch.Tensor, w_ov: torch.Tensor) -> float:
    """The composition score of equation (14.6): ``||W_QK W_OV||_F / (||W_QK||_F ||W_OV||_F)``."""
    return float(torch.linalg.matrix_norm(w_qk @ w_ov) / (torch.linalg.matrix_norm(w_qk)
                                                          * torch.linalg.matrix_norm(w_ov)))


def check_k_composition(fn: Callable) -> Verdict:
    """Exercise 14.3: ``fn(W_QK, W_OV) -> float``, the K-composition score (14.6) of a later head's ``W_QK`` and an
    earlier head's ``W_OV`` (both ``d_model x d_model``); the package's ``composition_scores`` is refused."""
    forbid = (interp.composition_scores, k_composition)

    def checks():
        g = torch.Generator().manual_seed(1403)
        cases = []
        for d, rank in ((8, 2), (16, 4), (32, 8)):
            w_qk = torch.randn(d, rank, generator=g, dtype=torch.float64) @ \
                torch.randn(rank, d, generator=g, dtype=torch.float64)
            w_ov = torch.randn(d, rank, generator=g, dtype=torch.float64) @ \
                torch.randn(rank, d, generator=g, dtype=torch.float64)
            cases.append((w_qk, w_ov))
        u = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))[0]
        cases.append((u[:, :4] @ u[:, :4].T, u[:, 4:] @ u[:, 4:].T))  # reads a subspace the other never writes: 0
        for k, (w_qk, w_ov) in enumerate(cases):
            expected = k_composition(w_qk, w_ov)
            reversed_order = k_composition(w_ov, w_qk)
            call = f"my_k_composition(W_QK, W_OV) for pair {k + 1} of {len(cases)} (d_model {w_qk.shape[0]})"
            got = call_reader(fn, w_qk, w_ov, call=call, names=("W_QK", "W_OV"), forbid=forbid)
            got = expect_number(got, call, "Return the score as a float (float(tensor)).")
            if abs(got - reversed_order) < 1e-6 and abs(reversed_order - expected) > 1e-6:
                raise Mismatch(f"{call} returned {got:.4f}, the score of W_OV W_QK",
                               "The later head reads what the earlier one wrote: the product is W_QK @ W_OV.")
            expect_close(got, expected, call, "Frobenius norm of the product W_QK @ W_OV divided by the product of "
                         "the two Frobenius norms (torch.linalg.matrix_norm).", rtol=1e-6, atol=1e-9)

    return run_checks("Exercise 14.3 (the K-composition score)", checks,
                      "Right on three random low-rank pairs and on a pair that cannot compose (score 0).")
