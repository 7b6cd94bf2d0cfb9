"""Checkers for chapter 14 (inside a trained transformer): finding the planted heads of a hand-built induction
model with the reader's own scores (14.1), mean-ablating one head position by position with the reader's own
hooks (14.2), the K-composition score and a row of the trained model's K-composition table (14.3), and three
tools one step beyond the chapter's: the logit lens read as ranks (14.7), direct logit attribution per head with
the final norm's divisor frozen (14.8) and activation patching per head (14.9).

Every checker computes the expected values before it calls the reader's function (which gets copies of its
inputs), refuses the package's own solution and checks the type of what comes back; those of 14.3's second part
and 14.2, 14.7-14.9 compute them with hooks and formulas of their own, not with the tools they refuse (the tests
check that the two agree). The checks of 14.1, 14.2 and 14.7-14.9
draw their token sequences afresh on every call (and 14.1 shuffles its four cases and how their weights are
disguised), so answers remembered from an earlier run do not pass.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable

import torch

from groundup import interpretability as interp
from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    expect_type,
    run_checks,
)
from groundup.induction import AttentionOnlyConfig, hand_built_induction_model, in_context_loss
from groundup.models import GPT, GPTConfig

__all__ = ["check_find_induction_circuit", "check_head_dla", "check_head_patching", "check_k_composition",
           "check_k_composition_row", "check_logit_lens_ranks", "check_mean_ablation", "permute_heads",
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


def planted_model(vocab_size: int, context_length: int, swap_layer1: bool, swap_layer2: bool, *,
                  decoy_larger: tuple[bool, bool] | None = None, generator: torch.Generator | None = None,
                  realistic_decoys: bool = False):
    """The hand-built induction model (:func:`groundup.induction.hand_built_induction_model`) with the heads of
    layer 1 and / or layer 2 swapped, and where its previous-token and induction heads then are:
    ``(model, ((0, prev_head), (1, induction_head)))``.

    ``realistic_decoys`` makes the decoys attend like heads of trained models instead of to their own positions
    (:func:`_retarget_decoys`): an ``i - 2`` head in the first layer and a duplicate-token head in the second, which
    is a previous-token head in the first half of a repeated sequence.

    ``decoy_larger`` (one bool per layer; None: the model as built) disguises the weights so that their size says
    nothing about which head is which: in a layer where it is True the decoy's weights are the larger by every
    measure below, where it is False the planted head's are, and the model computes the same function as the
    hand-built one with its decoys scaled as in the first point (up to float rounding; the tests check logits and
    attention patterns). Three changes do it, the last two drawn from ``generator``:

    * the decoy's own behaviour is scaled: its gain (what it writes) is 2 (larger) or 0.5 (smaller), and its
      query is multiplied by 3 or 0.7 (its attention stays where it was: the score gaps are 40 times that);
    * the head that is to be larger gets a *dead* part in its ``W_QK`` (``DEAD_QK_RANK`` singular values) and its
      ``W_OV`` (one), each singular value 2 to 3 times the nuclear norm of either head's: keys (and a value) that
      read coordinates of the ``OUT`` block, which is empty at the input of both blocks, so the part never changes
      a score or an output;
    * each head's ``W_q`` / ``W_k`` rows and ``W_v`` rows / ``W_o`` columns are refactored from its ``W_QK`` and
      ``W_OV`` (square roots of the singular values on both sides, then a random rotation of the head's ``d_head``
      coordinates, which the products do not see), so the slices are dense and their Frobenius norms are the
      square roots of the nuclear norms of ``W_QK`` and ``W_OV``.

    Then the larger head has the larger ``W_Q``, ``W_K``, ``W_V`` and ``W_O`` slices (Frobenius norm), the larger
    ``W_QK`` and ``W_OV`` (Frobenius, spectral and nuclear norm) and the larger OV circuit on the tokens (``W_OV``
    times the token embeddings); a checker that draws both directions for each layer defeats every guess of the
    form "the head with the larger (or smaller) weights".
    """
    if decoy_larger is not None and generator is None:
        raise ValueError("decoy_larger needs a generator to draw the disguise from")
    model = hand_built_induction_model(vocab_size, context_length, **({} if decoy_larger is None else
                                                                      {"decoy_gain": 1.0}))
    if realistic_decoys:
        _retarget_decoys(model)
    if decoy_larger is not None:
        for layer, larger in enumerate(decoy_larger):
            _scale_decoy(model, layer, larger)
            _disguise(model, layer, larger, generator)
    if swap_layer1:
        permute_heads(model, 0, [1, 0])
    if swap_layer2:
        permute_heads(model, 1, [1, 0])
    return model.eval(), ((0, int(swap_layer1)), (1, int(swap_layer2)))


DECOY_GAIN = {True: 2.0, False: 0.5}
"""What the decoy writes, times what the hand-built decoy writes, when it is to be the larger head or not."""
DECOY_QUERY = {True: 3.0, False: 0.7}
"""The decoy's query, times the hand-built decoy's: its score gaps are 40 times this (it still attends where it did)."""


def _retarget_decoys(model: GPT) -> None:
    """Make the decoys (head 1 of each block) of a hand-built model attend like heads found in trained models,
    so that no shortcut (the head that attends to itself least, the best previous-token score in both layers, an
    off-by-one induction score) finds the planted heads. Block 0's decoy attends from ``i`` to ``i - 2``
    (position 1 to 0); block 1's is a duplicate-token head: it attends to the earlier copy of its own token (``i -
    H`` in the repeated half) and, where there is none, to ``i - 1``. Both keep away from their own position. The
    scores are in units of the hand-built decoy's score gap (its query scale); what they read and write (their
    value and output) is unchanged, so the planted heads work as before."""
    c = model.config
    v, n, pos = c.vocab_size, c.context_length, c.vocab_size  # the POS block starts at v
    i = torch.arange(n)
    for layer, block in enumerate(model.blocks):
        attention = block.attention
        d_head = attention.d_head
        if n + v > d_head:
            raise ValueError(f"realistic decoys need context_length + vocab_size <= d_head = {d_head}")
        decoy = slice(d_head, 2 * d_head)
        with torch.no_grad():
            w_q, w_k = attention.W_q.weight[decoy], attention.W_k.weight[decoy]  # views
            unit = float(w_q[0, pos])  # the hand-built decoy's query: query POS_i, key POS_j (w_k's rows :n)
            scores = torch.zeros(n, n)  # scores[i, j]: query position i, key position j, in units
            back = 2 if layer == 0 else 1  # attend to i - 2 (block 0) or, without an earlier copy, i - 1 (block 1)
            scores[i[back:], i[back:] - back] = 1.0
            scores[i, i] = -2.0 if layer == 0 else -3.0  # the copy of the token itself scores 2 - 3 = -1
            w_q[:n, pos:pos + n] = unit * scores.T
            if layer == 1:  # query TOK_i, key TOK_j: 2 units for the same token
                w_q[n:n + v, :v] = 2 * unit * torch.eye(v)
                w_k[n:n + v, :v] = torch.eye(v)


def _scale_decoy(model: GPT, layer: int, larger: bool) -> None:
    """Scale the decoy (head 1) of block ``layer`` of a hand-built model: ``W_o``'s columns by
    ``DECOY_GAIN[larger]``, ``W_q``'s rows by ``DECOY_QUERY[larger]``."""
    attention = model.blocks[layer].attention
    decoy = slice(attention.d_head, 2 * attention.d_head)
    with torch.no_grad():
        attention.W_o.weight[:, decoy] *= DECOY_GAIN[larger]
        attention.W_q.weight[decoy] *= DECOY_QUERY[larger]


DEAD_QK_RANK = 8
"""The rank of the dead part of the larger head's ``W_QK``: enough that its ``W_Q`` and ``W_K`` slices (whose
nuclear norms are sums of square roots of ``W_QK``'s singular values) are the larger in nuclear norm too, even
against a realistic decoy's ``W_QK`` of rank up to ``context_length + vocab_size`` (:func:`_retarget_decoys`)."""


def _unit(d: int, i: int) -> torch.Tensor:
    e = torch.zeros(d, dtype=torch.float64)
    e[i] = 1.0
    return e


def _disguise(model: GPT, layer: int, decoy_larger: bool, g: torch.Generator) -> None:
    """Give the larger head of block ``layer`` (the decoy, head 1, when ``decoy_larger``; else the planted head 0)
    dead rank-one parts in ``W_QK`` and ``W_OV`` and refactor both heads' slices (see :func:`planted_model`)."""
    c = model.config
    v, n, d = c.vocab_size, c.context_length, c.d_model
    out, scratch = 2 * v + n, 3 * v + n  # where the OUT and SCRATCH blocks start (hand_built_induction_model)
    attention = model.blocks[layer].attention
    d_head = attention.d_head
    slices = [slice(h * d_head, (h + 1) * d_head) for h in range(2)]
    w_q, w_k, w_v, w_o = (m.weight.detach().double() for m in
                          (attention.W_q, attention.W_k, attention.W_v, attention.W_o))
    qk = [w_q[s].T @ w_k[s] for s in slices]
    ov = [w_o[:, s] @ w_v[s] for s in slices]
    nuclear = torch.linalg.matrix_norm

    def draw(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=g, dtype=torch.float64))

    big = 1 if decoy_larger else 0
    # dead parts: the keys (the value) read OUT_k (OUT_1), which are 0 at the input of both blocks; the queries read
    # SCRATCH_k and the output writes POS_0, directions outside the ones the heads' W_QK and W_OV use (queries
    # read TOK or POS, outputs write PREV, OUT or SCRATCH), so the singular values add up
    dead = torch.zeros(d, d, dtype=torch.float64)
    dead[range(scratch, scratch + DEAD_QK_RANK), range(out, out + DEAD_QK_RANK)] = 1.0
    qk[big] = qk[big] + draw(2.0, 3.0) * max(float(nuclear(m, "nuc")) for m in qk) * dead
    ov[big] = ov[big] + draw(2.0, 3.0) * max(float(nuclear(m, "nuc")) for m in ov) \
        * torch.outer(_unit(d, v), _unit(d, out + 1))
    with torch.no_grad():
        for h, s in enumerate(slices):
            for product, is_qk in ((qk[h], True), (ov[h], False)):
                u, sigma, vh = torch.linalg.svd(product)
                root = sigma[:d_head].sqrt()
                rotation = torch.linalg.qr(torch.randn(d_head, d_head, generator=g, dtype=torch.float64))[0]
                a = rotation @ (root[:, None] * u[:, :d_head].T)  # (d_head, d_model): aᵀ b = the product
                b = rotation @ (root[:, None] * vh[:d_head])
                if is_qk:
                    attention.W_q.weight[s] = a.float()
                    attention.W_k.weight[s] = b.float()
                else:
                    attention.W_o.weight[:, s] = a.T.float()
                    attention.W_v.weight[s] = b.float()


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
    order, on freshly drawn sequences. In two of them the decoys attend to their own positions, in the other two
    like heads of trained models (:func:`_retarget_decoys`: an ``i - 2`` head in layer 0, in layer 1 a
    duplicate-token head that attends to ``i - 1`` where its token has no earlier copy), each kind once with a
    layer's planted head at 0 and once at 1; so neither a shortcut (the best previous-token score in both layers,
    the head that attends to itself least, an induction score off by one) nor its opposite finds both planted heads
    every time. Their weights are disguised (:func:`planted_model`): in each layer the decoy has the larger weights
    by every measure in two of the four models and the smaller in the other two, so a guess from the size of the
    weights (the head with the largest, or the smallest, ``W_O``, ``W_V``, ``W_Q``, ``W_K``, ``W_OV`` or ``W_QK``,
    in any norm) fails on at least one of them."""
    forbid = (interp.previous_token_scores, interp.induction_scores, interp.composition_scores,
              interp.copying_scores, interp.copying_ranks, interp.ov_eigenvalue_scores, interp.head_matrices,
              interp.direct_logit_attribution, interp.ablate_heads.__wrapped__, interp.remove_from_inputs.__wrapped__)

    def checks():
        seed = _fresh_seed()
        g = torch.Generator().manual_seed(seed)
        shuffle = random.Random(seed)
        cases = [(16, 16, False, False), (16, 16, True, False), (24, 20, False, True), (24, 20, True, True)]
        sizes = [(True, True), (True, False), (False, True), (False, False)]  # in which layers the decoy is larger
        same = shuffle.random() < 0.5  # realistic decoys in the two models whose swaps agree, or in the other two:
        shuffle.shuffle(cases)  # then each kind of decoy has the planted head at 0 and at 1 in each layer
        shuffle.shuffle(sizes)
        for (vocab, context, swap1, swap2), larger in zip(cases, sizes):
            model, (prev, induction) = planted_model(vocab, context, swap1, swap2, decoy_larger=larger, generator=g,
                                                     realistic_decoys=(swap1 == swap2) == same)
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


# ---- Exercise 14.2: mean ablation with hooks of your own -------------------------------------------------------


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


def _replaced_loss(model: GPT, tokens: torch.Tensor, layer: int, head: int, value: torch.Tensor) -> float:
    """The in-context loss with head ``head`` of block ``layer`` replaced by ``value`` (``(seq, d_head)`` or
    ``(d_head,)``) at every position of every sequence."""
    d_head = model.config.d_model // model.config.n_heads

    def pre(module, args):
        z = args[0].clone()
        z[..., head * d_head:(head + 1) * d_head] = value
        return (z,) + tuple(args[1:])

    handle = model.blocks[layer].attention.W_o.register_forward_pre_hook(pre)
    try:
        return in_context_loss(model, tokens)
    finally:
        handle.remove()


def check_mean_ablation(fn: Callable) -> Verdict:
    """Exercise 14.2: ``fn(model, tokens, reference, layer, head) -> float``: the in-context loss
    (:func:`groundup.induction.in_context_loss`) on ``tokens`` with head ``head`` of block ``layer``
    mean-ablated as (14.8) defines it: its output at position ``i`` replaced by its mean output at position ``i``
    over the ``reference`` batch, by the reader's own hooks (``ablate_heads``, ``mean_head_outputs`` and
    ``head_outputs`` are refused), leaving the model as it was (no hook left registered). The expected loss comes
    from the checker's own hooks; the usual slips (zero instead of the mean, one mean over all positions, means of
    ``tokens`` instead of ``reference``, the wrong head) are named."""
    forbid = (interp.ablate_heads.__wrapped__, interp.mean_head_outputs, interp.head_outputs)

    def and_hooks_left(model, tokens, reference, layer, head):  # runs in the reader's thread, on copies
        return fn(model, tokens, reference, layer, head), _hooks_left(model)

    def checks():
        g = torch.Generator().manual_seed(_fresh_seed())
        hand, _ = planted_model(16, 16, False, False)
        cases = [("the hand-built model", hand, [(0, 0), (1, 0)]),
                 ("a random 4-head model", _random_model(14), [(0, 2), (1, 3)])]
        for label, model, heads in cases:
            tokens, reference = _permutation_repeats(8, 8, 16, g), _permutation_repeats(12, 8, 16, g)
            n_heads, d_head = model.config.n_heads, model.config.d_model // model.config.n_heads
            z_reference, z_tokens = _record_run(model, reference)[2], _record_run(model, tokens)[2]  # own hooks
            for layer, head in heads:
                z_ref = z_reference[layer][..., head, :]
                expected = _replaced_loss(model, tokens, layer, head, z_ref.mean(0))
                wrong = {
                    _replaced_loss(model, tokens, layer, head, torch.zeros(d_head)):
                        "That is zero ablation: replace the head's slice by its mean output over `reference`, "
                        "not by zeros.",
                    _replaced_loss(model, tokens, layer, head, z_ref.mean((0, 1))):
                        "You averaged over the positions too: (14.8) takes the mean separately at each position i "
                        "(average over the batch dimension only, keeping one mean per position).",
                    _replaced_loss(model, tokens, layer, head, z_tokens[layer][..., head, :].mean(0)):
                        "Those are the means of `tokens`, the batch you test on: take them from `reference`.",
                    in_context_loss(model, tokens):
                        "The loss did not change: does your pre-hook on blocks[layer].attention.W_o return the "
                        "modified input as a tuple?"}
                other = (head + 1) % n_heads
                wrong.setdefault(_replaced_loss(model, tokens, layer, other, z_reference[layer][..., other, :].mean(0)),
                                 "That is another head's mean ablation: head h owns W_o's input columns "
                                 "h * d_head .. (h + 1) * d_head - 1.")
                call = f"my_mean_ablated_loss(model, tokens, reference, {layer}, {head}) on {label}"
                got, left = call_reader(and_hooks_left, model, tokens, reference, layer, head, call=call,
                                        names=("model", "tokens", "reference", "layer", "head"), forbid=forbid)
                got = expect_number(got, call, "Return the loss as a float (float(loss)).")
                expect(left == 0, f"{call} left {left} hook(s) registered on the model",
                       "Remove every hook before returning: keep the handles that register_forward_pre_hook "
                       "returns and call handle.remove() in a `finally:` block, so the model is as it was.")
                for value, hint in wrong.items():
                    if abs(got - value) < 1e-5 and abs(value - expected) > 1e-4:
                        raise Mismatch(f"{call} returned {got:.4f}; with that head mean-ablated the loss is "
                                       f"{expected:.4f}", hint)
                expect_close(got, expected, call, "Record the head's slice of W_o's input on `reference` with one "
                             "pre-hook, average it over the batch (one mean per position), put that mean in the "
                             "slice with a second pre-hook, compute in_context_loss(model, tokens), then remove "
                             "the hooks.", rtol=1e-4, atol=1e-5)

    return run_checks("Exercise 14.2 (mean ablation with your own hooks)", checks,
                      "Your hooks replace one head by its mean output, position by position, on two models.")


# ---- Exercise 14.3: K-composition -------------------------------------------------------------------------------


def k_composition(w_qk: torch.Tensor, w_ov: torch.Tensor) -> float:
    """The composition score of equation (14.7): ``||W_QK W_OV||_F / (||W_QK||_F ||W_OV||_F)``."""
    return float(torch.linalg.matrix_norm(w_qk @ w_ov) / (torch.linalg.matrix_norm(w_qk)
                                                          * torch.linalg.matrix_norm(w_ov)))


def check_k_composition(fn: Callable) -> Verdict:
    """Exercise 14.3: ``fn(W_QK, W_OV) -> float``, the K-composition score (14.7) of a later head's ``W_QK`` and an
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


# ---- Exercise 14.3, second part: the trained model's row of the K-composition table ------------------------------


def _composition_model(seed: int, norm: str) -> GPT:
    """A random two-layer, three-head attention-only model whose first norms have random gains γ spread over
    a factor of 400 (and, for LayerNorm, shifts β), so that leaving the norm out of ``W_QK`` and ``W_OV`` changes
    the scores."""
    torch.manual_seed(seed)
    model = GPT(AttentionOnlyConfig(vocab_size=16, context_length=8, d_model=24, n_layers=2, n_heads=3, norm=norm,
                                    positional="rope", tie_weights=False)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.norm_1.weight.uniform_(-3.0, 3.0).exp_()  # gains from 0.05 to 20: the norm reshapes the space
            if getattr(block.norm_1, "bias", None) is not None:
                block.norm_1.bias.normal_(0.0, 0.5)
    return model


def _norm_matrix(norm: torch.nn.Module, d: int) -> torch.Tensor:
    """The linear part of a norm as a float64 matrix: diag(γ) for RMSNorm, diag(γ)(I - 11ᵀ/d) for LayerNorm."""
    gamma = torch.diag(norm.weight.detach().double())
    return gamma @ (torch.eye(d, dtype=torch.float64) - 1.0 / d) if getattr(norm, "bias", None) is not None \
        else gamma


def _circuits(model: GPT, layer: int, head: int, *, fold: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_QK, W_OV)`` of one head in float64 from the raw weights, the block's first norm folded in (or not)."""
    attention = model.blocks[layer].attention
    rows = slice(head * attention.d_head, (head + 1) * attention.d_head)
    n = _norm_matrix(model.blocks[layer].norm_1, model.config.d_model) if fold \
        else torch.eye(model.config.d_model, dtype=torch.float64)
    w_q, w_k, w_v = (m.weight.detach().double()[rows] @ n for m in (attention.W_q, attention.W_k, attention.W_v))
    return w_q.T @ w_k, attention.W_o.weight.detach().double()[:, rows] @ w_v


def _row(model: GPT, head: int, score, *, fold: bool = True) -> torch.Tensor:
    """``score(later head, earlier head)`` for head ``head`` of layer 0 against every head of layer 1."""
    early = _circuits(model, 0, head, fold=fold)
    return torch.tensor([score(_circuits(model, 1, j, fold=fold), early) for j in range(model.config.n_heads)],
                        dtype=torch.float64)


def check_k_composition_row(fn: Callable) -> Verdict:
    """Exercise 14.3, second part: ``fn(model, head) -> tensor (n_heads,)``, the row of the K-composition table
    for head ``head`` of layer 0: entry ``j`` is the score (14.7) of layer 1's head ``j`` reading what head
    ``head`` wrote, ``W_QK = W_Q.T @ W_K`` of head ``(1, j)`` and ``W_OV = W_O @ W_V`` of head ``(0, head)``, with
    each block's first norm folded in as ``interp.head_matrices`` does (use it with your ``my_k_composition``). Two
    random two-layer models whose norms have random gains (LayerNorm and RMSNorm); the package's
    ``composition_scores`` is refused."""
    forbid = (interp.composition_scores, k_composition, _row, _circuits)

    def checks():
        for seed, norm, head in ((1431, "layernorm", 1), (1432, "rmsnorm", 2)):
            model = _composition_model(seed, norm)
            expected = _row(model, head, lambda late, early: k_composition(late[0], early[1]))
            wrong = [("Fold the block's first norm into the weights (its γ, and for LayerNorm the centring): "
                      "interp.head_matrices folds it in, the raw weights (W_q.weight, ...) leave it out.",
                      _row(model, head, lambda late, early: k_composition(late[0], early[1]), fold=False)),
                     ("K-composition reads W_QK = W_Q.T @ W_K: the later head's keys read what the earlier head "
                      "wrote. W_K.T @ W_Q gives the Q-composition score.",
                      _row(model, head, lambda late, early: k_composition(late[0].T, early[1]))),
                     ("That is the V-composition score (W_OV @ W_OV); K-composition uses the later head's W_QK.",
                      _row(model, head, lambda late, early: k_composition(late[1], early[1]))),
                     ("The later head reads what the earlier one wrote: the product is W_QK @ W_OV, not W_OV @ W_QK.",
                      _row(model, head, lambda late, early: k_composition(early[1], late[0]))),
                     ("That is a column of the table: fix head `head` of layer 0 (its W_OV) and let the later head "
                      "of layer 1 vary.",
                      torch.tensor([k_composition(_circuits(model, 1, head)[0], _circuits(model, 0, i)[1])
                                    for i in range(model.config.n_heads)], dtype=torch.float64))]
            call = f"my_k_composition_row(model, {head}) on a random model with {norm}"
            got = call_reader(fn, model, head, call=call, names=("model", "head"), forbid=forbid)
            got = expect_tensor(got, call, "Return the row as a tensor of n_heads floats: torch.tensor(scores).")
            expect(got.is_floating_point(), f"{call} returned a {got.dtype} tensor", "The scores are floats.")
            expect(tuple(got.shape) == (model.config.n_heads,),
                   f"{call} returned shape {tuple(got.shape)}, expected ({model.config.n_heads},)",
                   "One score per head of layer 1, in head order.")
            for hint, value in wrong:
                if torch.allclose(got.double(), value, rtol=1e-4, atol=1e-6) \
                        and not torch.allclose(value, expected, rtol=1e-4, atol=1e-6):
                    raise Mismatch(f"{call} returned {got.double().numpy().round(4).tolist()}, not the row of "
                                   "K-composition scores", hint)
            expect_close(got, expected, call, "Entry j: my_k_composition(W_Q.T @ W_K of head (1, j), W_O @ W_V of "
                         "head (0, head)), with the matrices from interp.head_matrices.", rtol=1e-4, atol=1e-6)

    return run_checks("Exercise 14.3, second part (a row of the K-composition table)", checks,
                      "Your row matches on two random models, their norms folded in.")


# ---- shared by 14.2 and 14.7-14.9: small random models that do something, the checkers' own hooks -------------


def _random_gpt(seed: int, norm: str) -> GPT:
    """A random three-layer, four-head GPT with FFNs (LayerNorm, GELU, biases, learned positions; or RMSNorm,
    SwiGLU, no biases, RoPE) whose weights are drawn at a scale where every block changes the stream and the
    logits (linear weights N(0, 1/fan_in), embeddings N(0, 1), norm gains between 0.3 and 2.5, shifts and biases
    non-zero), so the logit lens changes from entry to entry and every head matters."""
    torch.manual_seed(seed)
    layernorm = norm == "layernorm"
    config = GPTConfig(vocab_size=40, context_length=12, d_model=32, n_layers=3, n_heads=4, d_ff=64, norm=norm,
                       positional="learned" if layernorm else "rope", activation="gelu" if layernorm else "swiglu",
                       bias=layernorm, tie_weights=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm_1.weight") or name.endswith("norm_2.weight") or name == "final_norm.weight":
                p.uniform_(0.3, 2.5)
            elif p.dim() == 2 and "embedding" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:  # biases and LayerNorm shifts
                p.normal_(0.0, 0.3)
    return model


def _record_run(model: GPT, ids: torch.Tensor, *, replace: dict | None = None):
    """One forward pass with the checker's own hooks: ``(logits, stream, z)``, the residual stream entries
    ``(n_layers + 1)`` x ``(batch, seq, d_model)`` (the input of block 0, then every block's output) and each
    layer's heads before ``W_o``, ``(batch, seq, n_heads, d_head)``. ``replace`` maps ``layer`` to a function
    ``z -> z`` applied to that layer's ``W_o`` input (a patch)."""
    c = model.config
    stream: dict[int, torch.Tensor] = {}
    z: dict[int, torch.Tensor] = {}
    handles = []

    def first(module, args):
        stream[0] = args[0].detach().clone()

    def after(layer):
        def hook(module, args, output):
            stream[layer + 1] = output.detach().clone()
        return hook

    def before_w_o(layer):
        def hook(module, args):
            x = args[0]
            if replace is not None and layer in replace:
                x = replace[layer](x)
            z[layer] = x.detach().reshape(*x.shape[:-1], c.n_heads, -1).clone()
            return (x,) + tuple(args[1:])
        return hook

    try:
        handles.append(model.blocks[0].register_forward_pre_hook(first))
        for layer, block in enumerate(model.blocks):
            handles.append(block.register_forward_hook(after(layer)))
            handles.append(block.attention.W_o.register_forward_pre_hook(before_w_o(layer)))
        with torch.no_grad():
            logits = model(ids)[0]
    finally:
        for handle in handles:
            handle.remove()
    return logits, [stream[i] for i in range(c.n_layers + 1)], [z[i] for i in range(c.n_layers)]


def _match(got: torch.Tensor, wrong: list[tuple[str, torch.Tensor]], expected: torch.Tensor, *, rtol: float,
           atol: float) -> str | None:
    """The hint of the first wrong value that ``got`` equals (one that differs from ``expected``)."""
    for hint, value in wrong:
        if got.shape == value.shape and torch.allclose(got.double(), value.double(), rtol=rtol, atol=atol) \
                and not torch.allclose(value.double(), expected.double(), rtol=rtol, atol=atol):
            return hint
    return None


# ---- Exercise 14.7: the logit lens as ranks -----------------------------------------------------------------------


def _ranks(logits: torch.Tensor, targets: torch.Tensor, slack: float = 0.0) -> torch.Tensor:
    """How many tokens have a logit larger than the target's by more than ``slack``: ``logits (..., seq, vocab)``,
    ``targets (seq,)``; 0 = the target is the top token."""
    chosen = logits.gather(-1, targets.expand(*logits.shape[:-1]).unsqueeze(-1))
    return (logits > chosen + slack).sum(-1)


def _lens(model: GPT, stream: list[torch.Tensor], norm: Callable | None) -> torch.Tensor:
    """``(n_layers + 1, seq, vocab)``: every stream entry (batch 1) through ``norm`` (None: none) and the
    unembedding."""
    with torch.no_grad():
        return torch.stack([model.unembedding(x[0] if norm is None else norm(x[0])) for x in stream])


def check_logit_lens_ranks(fn: Callable) -> Verdict:
    """Exercise 14.7: ``fn(model, ids, targets) -> ranks``, the logit lens read as ranks: for every residual
    stream entry (``0``: the embeddings, the input of block 0; ``l``: the output of block ``l - 1``; the last one
    is what the model's own logits come from) and every position ``i`` of the one sequence ``ids (1, seq)``, the
    rank of token ``targets[i]`` among the lens logits ``unembedding(final_norm(x))``, counted from 0: the number
    of tokens whose lens logit is larger (0 = the lens's top token). A ``(n_layers + 1, seq)`` int64 tensor.

    The checker reads the stream with its own hooks before it calls ``fn``; a rank within a rounding error of a
    tie is accepted either way. Two random three-layer GPTs with FFNs (LayerNorm and RMSNorm, random norm gains),
    on a sequence and targets drawn afresh; the package's ``logit_lens`` and ``residual_stream`` are refused
    (write the hooks)."""
    forbid = (interp.logit_lens, interp.residual_stream, _record_run, _lens, _ranks,
              Forbidden(interp, "_record", when=lambda args, kwargs: bool(kwargs.get("stream")),
                        label="groundup.interpretability._record (the hooks behind residual_stream)"))

    def checks():
        g = torch.Generator().manual_seed(_fresh_seed())
        for seed, norm in ((1471, "layernorm"), (1472, "rmsnorm")):
            model = _random_gpt(seed, norm)
            c = model.config
            seq = 10
            ids = torch.randint(0, c.vocab_size, (1, seq), generator=g)
            targets = torch.randint(0, c.vocab_size, (seq,), generator=g)
            logits, stream, _ = _record_run(model, ids)
            lens = _lens(model, stream, model.final_norm)
            slack = 1e-4 * float(lens.abs().max())
            expected = _ranks(lens, targets)
            # a rank within rounding of a tie is accepted either way (the target itself is not counted)
            low, high = _ranks(lens, targets, slack), _ranks(lens, targets, -slack) - 1
            torch.testing.assert_close(lens[-1], logits[0], rtol=1e-4, atol=1e-4)  # the last entry is the output
            bare = (torch.nn.functional.layer_norm if norm == "layernorm" else torch.nn.functional.rms_norm)
            v = c.vocab_size
            wrong = [("Apply the model's final norm before the unembedding, as the model itself does: "
                      "model.unembedding(model.final_norm(x)). Without it the ranks of the early entries are wrong.",
                      _ranks(_lens(model, stream, None), targets)),
                     ("Use the model's own final norm (model.final_norm), with its learned gain γ"
                      + (" and shift β" if norm == "layernorm" else "") + ", not a norm without them.",
                      _ranks(_lens(model, stream, functools.partial(bare, normalized_shape=(c.d_model,))),
                             targets)),
                     ("Count the rank from 0: the number of tokens whose lens logit is larger than the target's, "
                      "so the top token has rank 0 (you counted from 1).", expected + 1),
                     ("The rank counts the tokens whose logit is *larger* than the target's (0 = the top token); "
                      "you counted from the bottom (sort in descending order).", v - 1 - expected),
                     ("That is the rank of the lens's top token (always 0): rank targets[i] at position i instead.",
                      torch.zeros_like(expected)),
                     ("Entry 0 is the embeddings, the input of block 0 (a forward pre-hook on `model.blocks[0]`); "
                      "entry l is the output of block l - 1. Your entries are one block late.",
                      torch.cat([expected[1:], expected[-1:]])),
                     ("Entry l is the output of block l - 1 (a forward hook on `model.blocks[l - 1]`), so the last "
                      "entry is the output of the last block, whose lens is the model's own logits. Your entries "
                      "are one block early.", torch.cat([expected[:1], expected[:-1]]))]
            call = f"my_logit_lens_ranks(model, ids, targets) on a random 3-layer model with {norm}"
            got = call_reader(fn, model, ids, targets, call=call, names=("model", "ids", "targets"), forbid=forbid)
            got = expect_tensor(got, call, "Return the ranks as a (n_layers + 1, seq) int64 tensor.")
            shape = (c.n_layers + 1, seq)
            if tuple(got.shape) == (c.n_layers, seq):
                raise Mismatch(f"{call} returned shape {tuple(got.shape)}, expected {shape}",
                               "There are n_layers + 1 stream entries: the embeddings (the input of block 0), then "
                               "the output of every block.")
            if tuple(got.shape) in ((seq, c.n_layers + 1), (c.n_layers + 1, 1, seq)):
                raise Mismatch(f"{call} returned shape {tuple(got.shape)}, expected {shape}",
                               "One row per stream entry, one column per position: (n_layers + 1, seq), without "
                               "the batch dimension.")
            expect(tuple(got.shape) == shape, f"{call} returned shape {tuple(got.shape)}, expected {shape}",
                   "One row per stream entry (n_layers + 1), one column per position.")
            expect(not got.is_floating_point() and got.dtype != torch.bool,
                   f"{call} returned a {got.dtype} tensor", "Ranks are counts: return an integer tensor "
                   "(a sum of booleans is one; or call .long()).")
            expect(got.dtype == torch.int64, f"{call} returned a {got.dtype} tensor",
                   "Return the ranks as torch.int64 (.long()).")
            if bool(((got >= low) & (got <= high)).all()):
                continue
            hint = next((h for h, value in wrong if (got == value).double().mean() >= 0.9
                         and (value != expected).double().mean() > 0.1), None)  # near-ties may differ
            wrong_entries = ((got < low) | (got > high)).sum().item()
            raise Mismatch(f"{call}: {wrong_entries} of the {got.numel()} ranks are wrong", hint or (
                "For every entry x^(l) (batch 1, seq, d_model): logits = model.unembedding(model.final_norm(x)); "
                "the rank at position i is (logits[0, i] > logits[0, i, targets[i]]).sum()."))

    return run_checks("Exercise 14.7 (the logit lens as ranks)", checks,
                      "Your ranks match the lens on every stream entry and position, on two random models.")


# ---- Exercise 14.8: direct logit attribution per head --------------------------------------------------------------


def _dla(model: GPT, ids: torch.Tensor, position: int, token: int, *, frozen: bool = True, gamma: bool = True,
         centred: bool = True, shift: int = 0, at: int | None = None) -> dict[str, torch.Tensor]:
    """The direct logit attribution of ``logits[0, position, token]`` (float64), from the checker's own hooks;
    the keyword arguments leave out one step (for the hints): the frozen divisor, the gain γ, LayerNorm's
    centring; ``shift`` takes head ``h + shift``'s columns of ``W_o`` for head ``h``; ``at`` reads another
    position."""
    _, stream, z = _record_run(model, ids)
    p = position if at is None else at
    norm = model.final_norm
    layernorm = getattr(norm, "bias", None) is not None
    x = stream[-1][0, p].double()
    if layernorm:
        scale = 1.0 / math.sqrt(float(x.var(unbiased=False)) + norm.eps)
    else:
        scale = 1.0 / math.sqrt(float(x.pow(2).mean()) + norm.eps)
    u = model.unembedding.weight.detach().double()[token]
    read = u * norm.weight.detach().double() if gamma else u
    if not frozen:
        scale = 1.0

    def logit(part: torch.Tensor) -> torch.Tensor:  # what ``part`` (d_model,) adds to the logit, σ frozen
        if layernorm and centred:
            part = part - part.mean()
        return scale * (part @ read)

    c = model.config
    heads = torch.zeros(c.n_layers, c.n_heads, dtype=torch.float64)
    rest = torch.zeros(c.n_layers, dtype=torch.float64)
    for layer, block in enumerate(model.blocks):
        w_o = block.attention.W_o.weight.detach().double()
        d_head = w_o.shape[1] // c.n_heads
        zl = z[layer][0, p].double()  # (n_heads, d_head)
        written = torch.zeros(c.d_model, dtype=torch.float64)
        for h in range(c.n_heads):
            cols = slice(h * d_head, (h + 1) * d_head)
            written = written + w_o[:, cols] @ zl[h]
            k = (h + shift) % c.n_heads
            heads[layer, h] = logit(w_o[:, k * d_head:(k + 1) * d_head] @ zl[k])
        rest[layer] = logit(stream[layer + 1][0, p].double() - stream[layer][0, p].double() - written)
    bias = float(u @ norm.bias.detach().double()) if layernorm else 0.0
    return {"embedding": logit(stream[0][0, p].double()), "heads": heads, "rest": rest,
            "bias": torch.tensor(bias, dtype=torch.float64)}


_DLA_KEYS = ("embedding", "heads", "rest", "bias")
_DLA_PARTS = {"embedding": "the embeddings' part (stream entry 0, read like every other part)",
              "rest": "the rest of each block (its output minus its input minus its heads' outputs: the FFN and "
                      "W_o's bias), one number a block",
              "bias": "the final norm's shift β read by the target's unembedding row (u_t · β; 0 for RMSNorm, "
                      "which has no β)",
              "heads": "the heads' parts"}


def check_head_dla(fn: Callable) -> Verdict:
    """Exercise 14.8: ``fn(model, ids, position, token) -> parts``, the direct logit attribution of the logit
    ``logits[0, position, token]`` of the one sequence ``ids (1, seq)``, as ``interp.direct_logit_attribution``
    defines it: with ``x`` the final stream at that position, ``σ`` the final norm's divisor *from this run*
    (``sqrt(var(x) + eps)`` for LayerNorm, ``sqrt(mean(x²) + eps)`` for RMSNorm, frozen) and ``u`` the token's
    unembedding row, a part ``p`` of the stream contributes ``u · (γ ⊙ centre(p)) / σ`` (``centre`` subtracts the
    mean for LayerNorm, nothing for RMSNorm). ``parts`` is a dict: ``"heads"`` ``(n_layers, n_heads)``, each head's
    output ``W_O^h z^h``; ``"rest"`` ``(n_layers,)``, each block's output minus its input minus its heads' outputs
    (the FFN and ``W_o``'s bias); ``"embedding"``, stream entry 0; ``"bias"``, ``u · β`` (0 for RMSNorm). They add
    up to the logit, which the checker checks first.

    Two random three-layer GPTs with FFNs (LayerNorm with biases; RMSNorm), a sequence, position and token drawn
    afresh; the package's ``direct_logit_attribution`` and ``head_outputs`` are refused (hook ``W_o``'s input
    yourself; ``residual_stream`` is allowed)."""
    forbid = (interp.direct_logit_attribution, interp.head_outputs, interp.mean_head_outputs, interp._final_scale,
              _dla, _record_run,
              Forbidden(interp, "_record", when=lambda args, kwargs: bool(kwargs.get("heads")),
                        label="groundup.interpretability._record (the hooks behind head_outputs)"))

    def checks():
        g = torch.Generator().manual_seed(_fresh_seed())
        for seed, norm in ((1481, "layernorm"), (1482, "rmsnorm")):
            model = _random_gpt(seed, norm)
            c = model.config
            seq = 10
            ids = torch.randint(0, c.vocab_size, (1, seq), generator=g)
            position = int(torch.randint(2, seq - 2, (), generator=g))
            token = int(torch.randint(0, c.vocab_size, (), generator=g))
            logits, _, _ = _record_run(model, ids)
            logit = float(logits[0, position, token])
            expected = _dla(model, ids, position, token)
            wrong = [("Divide every part by the final norm's σ at that position, taken from this run and frozen: "
                      "sqrt(mean(x²) + eps) for RMSNorm, sqrt(var(x) + eps) for LayerNorm, x the final stream.",
                      _dla(model, ids, position, token, frozen=False)["heads"]),
                     ("Multiply by the final norm's gain γ (model.final_norm.weight): the logit reads "
                      "u · (γ ⊙ x) / σ, so each part is read by u ⊙ γ.",
                      _dla(model, ids, position, token, gamma=False)["heads"]),
                     ("LayerNorm subtracts the mean of x before it scales: centre each part (p - p.mean()) before "
                      "you read it (the means add up to the mean of x).",
                      _dla(model, ids, position, token, centred=False)["heads"]),
                     ("Head h is W_o's input columns h * d_head .. (h + 1) * d_head - 1 and W_o's weight columns "
                      "with the same indices: you paired head h with the next head's slice.",
                      _dla(model, ids, position, token, shift=1)["heads"]),
                     ("Read the stream and the heads at `position`, not at the last position.",
                      _dla(model, ids, position, token, at=seq - 1)["heads"])]
            per_part_norm = torch.zeros(c.n_layers, c.n_heads, dtype=torch.float64)
            _, _, z = _record_run(model, ids)
            with torch.no_grad():
                for layer, block in enumerate(model.blocks):
                    w_o = block.attention.W_o.weight.detach().double()
                    d_head = w_o.shape[1] // c.n_heads
                    for h in range(c.n_heads):
                        part = w_o[:, h * d_head:(h + 1) * d_head] @ z[layer][0, position, h].double()
                        per_part_norm[layer, h] = model.unembedding(model.final_norm(part.float()))[token].double()
            wrong.append(("The final norm is not applied to each part on its own: its divisor σ is the final "
                          "stream's (one number from this run, frozen), the same for every part.", per_part_norm))
            where = f" (a random 3-layer model with {norm})"
            call = f"my_head_dla(model, ids, {position}, {token})"
            got = call_reader(fn, model, ids, position, token, call=call + where,
                              names=("model", "ids", "position", "token"), forbid=forbid)

            def part(key: str, call: str = call, where: str = where) -> str:
                return f'{call}["{key}"]{where}'

            call += where
            got = expect_type(got, dict, call, "a dict of the parts",
                              'Return {"heads": ..., "rest": ..., "embedding": ..., "bias": ...}.')
            missing = [k for k in _DLA_KEYS if k not in got]
            expect(not missing, f"{call} returned a dict without {', '.join(map(repr, missing))}",
                   'Return {"heads": (n_layers, n_heads), "rest": (n_layers,), "embedding": a number, '
                   '"bias": a number}.')
            heads = expect_tensor(got["heads"], part("heads"))
            rest = expect_tensor(got["rest"], part("rest"))
            expect(heads.is_floating_point() and rest.is_floating_point(), f"{call}: the parts are not floats",
                   "Return float tensors.")
            if tuple(heads.shape) == (c.n_heads, c.n_layers):
                raise Mismatch(f"{part('heads')} has shape {tuple(heads.shape)}, expected "
                               f"{(c.n_layers, c.n_heads)}", "One row per layer, one column per head.")
            expect(tuple(heads.shape) == (c.n_layers, c.n_heads),
                   f"{part('heads')} has shape {tuple(heads.shape)}, expected {(c.n_layers, c.n_heads)}",
                   "One number per head: (n_layers, n_heads), for the one position and token.")
            expect(tuple(rest.shape) == (c.n_layers,),
                   f"{part('rest')} has shape {tuple(rest.shape)}, expected {(c.n_layers,)}",
                   "One number per block: its output minus its input minus its heads' outputs, read like the "
                   "heads.")
            embedding = expect_number(got["embedding"], part("embedding"), "Give the embedding's part as a number "
                                      "(float(...)).")
            bias = expect_number(got["bias"], part("bias"), "Give the bias part as a number (0.0 for RMSNorm).")
            hint = _match(heads, wrong, expected["heads"], rtol=1e-4, atol=1e-4)
            if hint:
                raise Mismatch(f"{call}: the heads' parts are computed the wrong way", hint)
            total = embedding + float(heads.double().sum()) + float(rest.double().sum()) + bias
            if abs(total - logit) > 1e-4 * max(1.0, abs(logit)):
                off = [k for k in _DLA_KEYS if not torch.allclose(
                    torch.as_tensor(got[k] if k in ("heads", "rest") else float(got[k]), dtype=torch.float64),
                    expected[k].double(), rtol=1e-4, atol=1e-4)]
                raise Mismatch(f"{call}: the parts add up to {total:.5f}, the logit is {logit:.5f}",
                               f"Check {_DLA_PARTS[off[0]]}." if off else
                               "Embedding + heads + rest + bias must give the logit exactly (up to rounding).")
            for key, value in (("heads", heads), ("rest", rest), ("embedding", embedding), ("bias", bias)):
                expect_close(value, expected[key].float() if key in ("heads", "rest") else float(expected[key]),
                             part(key), f"Check {_DLA_PARTS[key]}: u · (γ ⊙ centre(part)) / σ.",
                             rtol=1e-4, atol=1e-4)

    return run_checks("Exercise 14.8 (direct logit attribution per head)", checks,
                      "Your parts match, head by head, and add up to the logit, on a LayerNorm and an RMSNorm model.")


# ---- Exercise 14.9: activation patching per head -------------------------------------------------------------------


def _patch_model(seed: int, kind: str) -> GPT:
    """:func:`_random_gpt` (``kind`` "layernorm") or a random two-layer, four-head attention-only model with RMSNorm
    and RoPE whose weights are drawn at the same scale (``kind`` "attention-only")."""
    if kind != "attention-only":
        return _random_gpt(seed, kind)
    torch.manual_seed(seed)
    model = GPT(AttentionOnlyConfig(vocab_size=40, context_length=12, d_model=32, n_layers=2, n_heads=4,
                                    norm="rmsnorm", positional="rope", tie_weights=False, bias=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.3, 2.5)
            elif "embedding" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model


def _logit_diff(logits: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """Per example: ``logits[b, -1, answer[b]] - logits[b, -1, wrong[b]]`` in float64."""
    last = logits[:, -1].double()
    rows = torch.arange(last.shape[0])
    return last[rows, answer] - last[rows, wrong]


def _head_patches(model: GPT, source: torch.Tensor, target: torch.Tensor, answer: torch.Tensor,
                  wrong: torch.Tensor, *, positions: slice = slice(None), shift: int = 0,
                  whole_layer: bool = False) -> torch.Tensor:
    """``(n_layers, n_heads, batch)``: the logit differences of the run on ``target`` with head ``(l, h)``'s output
    (``W_o``'s input slice, at ``positions``) taken from the run on ``source``; ``shift`` patches head ``h +
    shift``'s slice in head ``h``'s place, ``whole_layer`` every head of the layer."""
    c = model.config
    _, _, z_source = _record_run(model, source)
    out = torch.zeros(c.n_layers, c.n_heads, source.shape[0], dtype=torch.float64)
    for layer in range(c.n_layers):
        for h in range(c.n_heads):
            k = (h + shift) % c.n_heads

            def patch(x, layer=layer, k=k):
                split = x.reshape(*x.shape[:-1], c.n_heads, -1).clone()
                heads = slice(None) if whole_layer else k
                split[:, positions, heads] = z_source[layer][:, positions, heads].to(x.dtype)
                return split.reshape(x.shape)

            logits, _, _ = _record_run(model, target, replace={layer: patch})
            out[layer, h] = _logit_diff(logits, answer, wrong)
    return out


def _patching_case(model: GPT, g: torch.Generator, batch: int = 3, seq: int = 8):
    """A clean batch, its corrupted copy (one token changed early in every sequence, at position 1 or 2) and, per
    example, the answer and the wrong token: the pair of tokens whose logit difference at the last position the
    corruption changes most, so that clean and corrupted differ by a clear margin."""
    v = model.config.vocab_size
    clean = torch.randint(0, v, (batch, seq), generator=g)
    corrupted = clean.clone()
    where = torch.randint(1, 3, (batch,), generator=g)
    rows = torch.arange(batch)
    corrupted[rows, where] = (clean[rows, where] + torch.randint(1, v, (batch,), generator=g)) % v
    with torch.no_grad():
        change = (model(clean)[0][:, -1] - model(corrupted)[0][:, -1]).double()
    return clean, corrupted, change.argmax(-1), change.argmin(-1)


def check_head_patching(fn: Callable) -> Verdict:
    """Exercise 14.9: ``fn(model, clean_ids, corrupted_ids, answer, wrong) -> (n_layers, n_heads)``, activation
    patching per head, denoising: run the corrupted batch with head ``(l, h)``'s output at every position (its
    slice of ``W_o``'s input) replaced by the same head's output in the clean run, and return

        (LD(patched) - LD(corrupted)) / (LD(clean) - LD(corrupted))

    where ``LD(run)`` is the mean over the batch of ``logits[b, -1, answer[b]] - logits[b, -1, wrong[b]]`` (a
    ratio of means, normalised as ``interp.residual_patching`` is: 0 = the corrupted run, 1 = the clean run).
    ``answer`` and ``wrong`` are ``(batch,)`` token ids. A random three-layer GPT with FFNs (LayerNorm) and a
    random two-layer attention-only model (RMSNorm, RoPE), batches drawn afresh; the package's
    ``residual_patching``, ``patch_residual`` and ``ablate_heads`` are refused (``head_outputs`` is allowed)."""
    forbid = (interp.residual_patching, interp.patch_residual.__wrapped__, interp.ablate_heads.__wrapped__,
              _head_patches, _record_run)

    def checks():
        g = torch.Generator().manual_seed(_fresh_seed())
        for seed, kind in ((1491, "layernorm"), (1492, "attention-only")):
            model = _patch_model(seed, kind)
            c = model.config
            clean, corrupted, answer, wrong_ids = _patching_case(model, g)
            with torch.no_grad():
                ld_clean = _logit_diff(model(clean)[0], answer, wrong_ids)
                ld_corrupted = _logit_diff(model(corrupted)[0], answer, wrong_ids)
            gap = float(ld_clean.mean() - ld_corrupted.mean())
            denoised = _head_patches(model, clean, corrupted, answer, wrong_ids)
            expected = (denoised.mean(-1) - ld_corrupted.mean()) / gap
            noised = _head_patches(model, corrupted, clean, answer, wrong_ids)
            layer_patch = _head_patches(model, clean, corrupted, answer, wrong_ids, whole_layer=True)
            per_example = ((denoised - ld_corrupted) / (ld_clean - ld_corrupted)).mean(-1)
            wrong = [("That is noising (the clean run with the corrupted head patched in). Denoise: run the "
                      "*corrupted* batch and put the *clean* run's head output in.",
                      (noised.mean(-1) - ld_corrupted.mean()) / gap),
                     ("That is noising, as the share of the effect lost (clean run, corrupted head). Denoise: run "
                      "the corrupted batch and put the clean run's head output in.",
                      (ld_clean.mean() - noised.mean(-1)) / gap),
                     ("Normalise: subtract LD(corrupted) and divide by LD(clean) - LD(corrupted), so that 0 is the "
                      "corrupted run and 1 the clean run.", denoised.mean(-1) - ld_corrupted.mean()),
                     ("Normalise by the gap: (LD(patched) - LD(corrupted)) / (LD(clean) - LD(corrupted)), not "
                      "LD(patched) / LD(clean).", denoised.mean(-1) / ld_clean.mean()),
                     ("Take a ratio of means: average the logit differences over the batch first, then normalise "
                      "once (as residual_patching does), not the mean of each example's ratio.", per_example),
                     ("Every head of a layer got the same value: you patched the whole layer (all heads, the "
                      "attention output or the residual stream). Replace only head h's slice h * d_head .. "
                      "(h + 1) * d_head - 1 of W_o's input.", (layer_patch.mean(-1) - ld_corrupted.mean()) / gap),
                     ("Every entry is 1: patching the whole residual stream at every position restores the clean "
                      "run. Patch one head's output (its slice of W_o's input), not the stream.",
                      torch.ones(c.n_layers, c.n_heads, dtype=torch.float64)),
                     ("Patch the head's output at every position, not only at the last one: the corruption is "
                      "early in the sequence, and later positions read it through attention.",
                      (_head_patches(model, clean, corrupted, answer, wrong_ids, positions=slice(-1, None))
                       .mean(-1) - ld_corrupted.mean()) / gap),
                     ("Head h owns W_o's input columns h * d_head .. (h + 1) * d_head - 1: you patched the next "
                      "head's slice.", (_head_patches(model, clean, corrupted, answer, wrong_ids, shift=1)
                                        .mean(-1) - ld_corrupted.mean()) / gap)]
            call = (f"my_head_patching(model, clean_ids, corrupted_ids, answer, wrong) on a random {c.n_layers}-layer "
                    f"{'attention-only model' if kind == 'attention-only' else 'GPT with FFNs'}")
            got = call_reader(fn, model, clean, corrupted, answer, wrong_ids, call=call,
                              names=("model", "clean_ids", "corrupted_ids", "answer", "wrong"), forbid=forbid)
            got = expect_tensor(got, call, "Return a (n_layers, n_heads) tensor of floats.")
            expect(got.is_floating_point(), f"{call} returned a {got.dtype} tensor", "Return float values.")
            shape = (c.n_layers, c.n_heads)
            expect(tuple(got.shape) == shape, f"{call} returned shape {tuple(got.shape)}, expected {shape}",
                   "One number per head: rows are layers, columns heads." if tuple(got.shape) != shape[::-1]
                   else "Rows are layers, columns heads: you returned the transpose.")
            hint = _match(got, wrong, expected, rtol=1e-3, atol=1e-3)
            if hint:
                raise Mismatch(f"{call}: the values are not the share of the logit difference each head restores",
                               hint)
            expect_close(got, expected, call, "For each head: the corrupted run with that head's clean output "
                         "(W_o's input slice, every position) patched in; LD = mean over the batch of the logit "
                         "differences at the last position; (LD - LD_corrupted) / (LD_clean - LD_corrupted).",
                         rtol=1e-3, atol=1e-3)

    return run_checks("Exercise 14.9 (activation patching per head)", checks,
                      "Your table matches the share of the logit difference each head's clean output restores, "
                      "on two random models.")
