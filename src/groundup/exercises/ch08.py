"""Checkers for chapter 8 (generation): Exercise 8.1 (min-p sampling), 8.2 (a repetition penalty), 8.3 (top-p
filtering) and 8.4 (the KV cache of a real model, with grouped-query attention).

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), checks the type of what comes back, and
compares at a tolerance that fits the dtype. Every exercise refuses answers that call the book's own generation
code (every function ``groundup.generation`` defines), the benchmark's ``kv_cache_bytes``, this module's own
functions (the references that compute the expected values, and the helpers that compute the typical mistakes)
or the library's implementation (transformers' ``MinPLogitsWarper`` for 8.1, ``RepetitionPenaltyLogitsProcessor``
and ``EncoderRepetitionPenaltyLogitsProcessor`` for 8.2, ``TopPLogitsWarper`` for 8.3, building one or calling
it); 8.4 also refuses building a model, block or attention layer to measure its cache. The functions' code is
swapped for a tripwire while the reader's function runs (:func:`groundup.exercises.checking.call_refusing`), so a
reference saved before the check (an alias, ``MinPLogitsWarper.__call__``, an instance built before) is caught
too, and a refusal stands even if the reader's code catches the exception.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable

import torch

from groundup import generation
from groundup.attention import MultiHeadAttention
from groundup.bench.generation import kv_cache_bytes
from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Shortcuts,
    Verdict,
    call_refusing,
    collect_shortcuts,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    function_code,
    module_functions,
    package_functions,
    run_checks,
)
from groundup.layers import TransformerBlock
from groundup.models import GPT, GPTConfig

__all__ = ["check_min_p_filter", "check_repetition_penalty", "check_top_p_filter", "check_kv_cache_memory_gqa"]

INF = float("-inf")
_TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _expect_same_dtype(got: torch.Tensor, dtype: torch.dtype, call: str) -> None:
    expect(got.dtype == dtype, f"{call} returned dtype {got.dtype} for a {dtype} input",
           "Keep the input's dtype (no .float() or .double()): the result should be a tensor of the same kind.")


def _expect_filtered(got: torch.Tensor, expected: torch.Tensor, call: str, hint: str) -> None:
    """``got`` has -inf exactly where ``expected`` does and the original logits everywhere else."""
    expect(got.shape == expected.shape, f"{call} returned shape {tuple(got.shape)}, expected "
           f"{tuple(expected.shape)}", "Return logits of the same shape as the input, with removed entries -inf.")
    removed = torch.isneginf(expected)
    if bool((got >= 0).all()) and bool(torch.allclose(got.sum(-1).double(), torch.ones(1, dtype=torch.float64))):
        raise Mismatch(f"{call} returned probabilities (each row sums to 1)",
                       "Return filtered logits, not probabilities: the removed entries -inf, the kept ones unchanged.")
    if removed.any() and bool(torch.isfinite(got[removed]).all()):
        if bool((got[removed] == 0).all()):
            raise Mismatch(f"{call} set the removed logits to 0",
                           "Set removed logits to float('-inf'): a logit of 0 still gets probability e⁰ / Σ > 0 in "
                           "the softmax; -inf gets exactly 0.")
        if bool((got[removed] < -1e3).all()):
            raise Mismatch(f"{call} set the removed logits to a large negative number",
                           "Use float('-inf') rather than a large negative number: it gives probability exactly 0 "
                           "in any dtype and marks the removed tokens unambiguously.")
    if not torch.equal(torch.isneginf(got), removed):
        kept_got = (~torch.isneginf(got)).sum(-1).flatten().tolist()
        kept_expected = (~removed).sum(-1).flatten().tolist()
        if kept_got == kept_expected:
            raise Mismatch(f"{call} kept the right number of tokens ({kept_expected} per row) but not the right "
                           "ones", hint)
        raise Mismatch(f"{call} kept {kept_got} token(s) per row, expected {kept_expected}", hint)
    expect_close(got[~removed], expected[~removed], f"{call}: the kept logits",
                 "Leave the kept logits unchanged (no softmax, no temperature): only set the removed ones to -inf.",
                 **_TOLERANCE.get(expected.dtype, _TOLERANCE[torch.float32]))


# ---- what the exercises refuse -----------------------------------------------------------------------------


_BOOK_HINT = ("The exercise is to compute it yourself with torch operations: groundup.generation is the book's own "
              "generation code, so an answer that calls it proves nothing.")
_BENCH_HINT = ("The exercise is to compute it yourself from the config's fields: {name} is the book's own solution, so "
               "an answer that calls it proves nothing.")
_REFERENCE_HINT = ("The exercise is to compute it yourself: {name} is the checker's own code, "
                   "which computes the expected answer (or a typical mistake), so an answer that calls it proves "
                   "nothing.")
_LIBRARY_HINT = ("The exercise is to write it yourself with torch operations: {name} is the library's own "
                 "implementation, so an answer that calls it proves nothing.")


def _book_code() -> list:
    """Entries for :func:`collect_shortcuts`: every function ``groundup.generation`` defines (under its decorators;
    one added later too), the benchmark's ``kv_cache_bytes``, and every function of this module (the references
    that compute the expected values, the helpers that compute the typical mistakes, the checkers), each with its
    hint. Read when a check runs."""
    own = sys.modules[__name__]
    return ([(fn, label, _BOOK_HINT) for fn, label in module_functions(generation)]
            + [(fn, "groundup.bench.generation.kv_cache_bytes", _BENCH_HINT)
               for fn, _ in package_functions(kv_cache_bytes)]
            + [(fn, label, _REFERENCE_HINT) for fn, label in module_functions(own)])


@functools.cache
def _library_processors(names: tuple[str, ...]) -> tuple:
    """Entries for :func:`collect_shortcuts`: building or calling transformers' logits processors ``names`` (the
    code of their ``__init__`` and ``__call__``: an instance built before the check, or a method saved from the
    class, is caught too); none where transformers is missing or broken (then there is nothing of it to call).
    Imported here, before the reader's function runs, so that a function importing transformers itself is caught
    too."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers.generation import logits_process
    except Exception:  # noqa: BLE001 -- any failure of the optional library means it cannot be called either
        return ()
    entries = []
    for name in names:
        cls = getattr(logits_process, name, None)
        shown = f"transformers.{name}"
        for attribute in ("__init__", "__call__"):
            if isinstance(cls, type) and attribute in vars(cls):
                inner = function_code(vars(cls)[attribute])
                if inner is None or not inner.__module__.startswith("transformers."):  # not the library's code
                    inner = Forbidden(cls, attribute, label=shown)
                entries.append((inner, shown, _LIBRARY_HINT))
    return tuple(entries)


def _shortcuts(library: tuple[str, ...], *more) -> Shortcuts:
    """What an exercise refuses: the book's code (:func:`_book_code`), transformers' processors ``library`` and
    the entries ``more``."""
    return collect_shortcuts([*_book_code(), *_library_processors(library), *more], _REFERENCE_HINT)


def _call_with_hint(fn: Callable, call: str, args: tuple, names: tuple[str, ...], shortcuts: Shortcuts, hint: str):
    """``fn(*args)`` through :func:`call_refusing` (copies, a time bound, ``shortcuts`` refused, an input changed in
    place reported); a crash of the reader's function is reported with ``hint``."""
    return call_refusing(fn, *args, call=call, names=names, shortcuts=shortcuts, crash_hint=hint)


# ---- Exercise 8.1 ------------------------------------------------------------------------------------------


def _reference_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """transformers' ``MinPLogitsWarper(min_p)`` rule: remove the tokens whose probability is strictly below
    ``min_p`` times the row's largest probability (the tests compare the two)."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), INF)


def _min_p_cases() -> list[tuple[torch.Tensor, float, str]]:
    """(logits, min_p, how the logits are shown): the seeds' example, batches of 1, 2 and 3 dimensions in float64
    and float32, rows with ties at the top, a row where only the top survives, a row with tokens removed already,
    rows on different scales, and min_p = 1. No probability lies within a relative 1e-4 of its threshold except
    the exact ties at min_p = 1 (the tests check it), so any correct way of comparing gives the same tokens."""
    # log p + 3: logits of either sign, so that comparing logits, or probabilities with min_p itself, each keep
    # another number of tokens (1 and 0) than the 3 of the right rule
    seeds = torch.tensor([0.1, 0.05, 0.03, 0.02] + [0.01] * 80, dtype=torch.float64).log() + 3.0
    g = torch.Generator().manual_seed(85)
    rows = torch.randn(5, 40, generator=g, dtype=torch.float64) * 2
    rows[1, [3, 17]] = rows[1].max() + 0.5  # two tokens tie for the top
    rows[2, 11] += 12.0  # far ahead of the rest: only it survives
    rows[3, :12] = INF  # removed already (top-k before min-p, say): stays removed
    rows[4] += 5.0  # on another scale than the other rows
    batch3 = torch.randn(2, 3, 30, generator=g) * 2.5
    vector = torch.randn(25, generator=g) * 2
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0], [0.5, -1.0, 2.0, 2.0, 1.9, -3.0]], dtype=torch.float64)
    ties_text = "[[1, 3, 3, 2, 3, 0], [0.5, -1, 2, 2, 1.9, -3]]"
    return [(seeds, 0.25, "the seeds' example (bananas 0.1, cherries 0.05, fruit 0.03, cake 0.02, 80 x 0.01)"),
            (rows, 0.1, "random logits of shape (5, 40)"), (rows, 0.02, "random logits of shape (5, 40)"),
            (batch3, 0.05, "float32 logits of shape (2, 3, 30)"), (vector, 0.3, "float32 logits of shape (25,)"),
            (ties, 1.0, ties_text), (ties, 0.5, ties_text)]


_MIN_P_HINT = ("Take the softmax of each row, its largest probability p_max (amax(dim=-1, keepdim=True)), and set to "
               "-inf the logits of the tokens whose probability is below min_p * p_max; the others stay as they were.")


def _min_p_hint(removed: torch.Tensor, x: torch.Tensor, min_p: float) -> str:
    """The hint for the typical min-p mistakes, read off which tokens the reader removed (``removed``). A mistake
    is named only where its tokens differ from the right ones, and in an order that names each at its first failing
    case: at min_p = 1 both ``<=`` and ``p < min_p`` remove everything, but ``p < min_p`` fails the seeds' example
    first; with a row whose top token has probability ~1 the batch's maximum and ``p < min_p`` agree, but in a
    1-D example they differ."""
    probs = torch.softmax(x, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    want = probs < min_p * top
    wrong = [(x < min_p * x.amax(dim=-1, keepdim=True),
              "Compare probabilities, not logits: logits can be negative and are defined only up to a constant, "
              "so min_p * (largest logit) is no threshold. Take the softmax first, then remove p < min_p * p_max."),
             (probs <= min_p * top,
              "Remove only the tokens strictly below the threshold: a probability equal to min_p * p_max stays, so "
              "with min_p = 1 the most probable token (and every token tied with it) survives."),
             (probs < min_p * probs.amax(),
              "Take the largest probability of each row (amax(dim=-1, keepdim=True)), not of the whole batch: "
              "every row is a distribution of its own."),
             (probs < min_p,
              "min_p is relative to the most probable token: remove the tokens with p < min_p * p_max, not p < min_p "
              "(an absolute threshold removes every token of a flat distribution).")]
    if x.dim() > 1:
        over_batch = torch.softmax(x, dim=0)
        over_all = torch.softmax(x.flatten(), dim=0).view_as(x)
        for p in (over_batch, over_all):
            wrong.append((p < min_p * p.amax(dim=-1, keepdim=True),
                          "Take the softmax over the vocabulary, the last dimension (dim=-1), not over dim=0 or the "
                          "whole tensor: every row is a distribution of its own."))
    for mask, hint in wrong:
        if torch.equal(removed, mask) and not torch.equal(mask, want):
            return hint
    return _MIN_P_HINT


_MIN_P_LIBRARY = ("MinPLogitsWarper",)


def check_min_p_filter(fn: Callable) -> Verdict:
    """Exercise 8.1 (min-p sampling; Nguyen et al., 2024): ``fn(logits, min_p)``, for logits of shape ``(..., V)``
    (float32 or float64) and ``0 < min_p <= 1``, returns a new tensor of the same shape and dtype in which the
    logit of every token whose probability (the softmax over the last dimension) is below ``min_p`` times the
    largest probability of its row is ``-inf``, and every other logit is unchanged.

    The comparison is transformers' (``MinPLogitsWarper``): a token is removed when ``p < min_p * p_max``, so a
    probability equal to the threshold stays, and ``min_p = 1`` keeps the most probable token and every token tied
    with it. Logits that are ``-inf`` already stay ``-inf``. A ``min_p`` outside ``(0, 1]`` is not part of the
    exercise: no case has one, and the function may do what it likes with it. Refused: transformers'
    ``MinPLogitsWarper``, every function of ``groundup.generation`` and this module's own functions (however they
    are reached: an alias or an instance made before the check is caught too)."""

    _library_processors(_MIN_P_LIBRARY)  # imports transformers outside the time bound

    def checks():
        cases = _min_p_cases()
        expected = [_reference_min_p(x, min_p) for x, min_p, _ in cases]  # before any tripwire is set
        shortcuts = _shortcuts(_MIN_P_LIBRARY)
        for (x, min_p, what), want in zip(cases, expected):
            call = f"min_p_filter({what}, min_p={min_p:g})"
            got = expect_tensor(_call_with_hint(fn, call, (x, min_p), ("logits", "min_p"), shortcuts, _MIN_P_HINT),
                                call, "Return the filtered logits as a torch.Tensor.")
            hint = _MIN_P_HINT
            if got.shape == x.shape:
                hint = _min_p_hint(torch.isneginf(got), x, min_p)
            _expect_same_dtype(got, x.dtype, call)
            _expect_filtered(got, want, call, hint)

    return run_checks("Exercise 8.1 (min-p sampling)", checks,
                      "With min_p = 0.25 the seeds' bananas, cherries and fruit stay (0.03 >= 0.25 x 0.1) and cake "
                      "is out: the threshold follows the most probable token.")


# ---- Exercise 8.2 ------------------------------------------------------------------------------------------


def _reference_repetition_penalty(logits: torch.Tensor, ids: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor(theta)`` rule (the tests compare the two)."""
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, ids, True)
    return torch.where(seen, torch.where(logits < 0, logits * theta, logits / theta), logits)


def _repetition_cases() -> list[tuple[torch.Tensor, torch.Tensor, float, str]]:
    """(logits, ids, theta, how they are shown): a small example that shows each mistake (token 0 occurs three
    times, token 3 has logit 0), a float64 batch with zero logits whose rows have seen different tokens, a float32
    batch."""
    example = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 1.5]], dtype=torch.float64)
    example_ids = torch.tensor([[0, 1, 3, 0, 0]])
    g = torch.Generator().manual_seed(86)
    rows = torch.randn(3, 16, generator=g, dtype=torch.float64) * 2
    rows[:, ::5] = 0.0  # zero logits: neither positive nor negative, unchanged either way
    row_ids = torch.randint(0, 16, (3, 10), generator=g)
    batch = torch.randn(4, 50, generator=g) * 3
    batch_ids = torch.randint(0, 50, (4, 24), generator=g)
    return [(example, example_ids, 2.0, "logits [[2, -1, 0.5, 0, -3, 1.5]], ids [[0, 1, 3, 0, 0]]"),
            (rows, row_ids, 1.2, "random logits of shape (3, 16) with zeros, ids of shape (3, 10)"),
            (batch, batch_ids, 1.5, "float32 logits of shape (4, 50), ids of shape (4, 24)")]


_REPETITION_HINT = ("For each row b, every token t that occurs in ids[b] gets logits[b, t] / theta if that logit is "
                    "positive and logits[b, t] * theta if it is negative, once however often t occurs; the other "
                    "logits stay as they are. (logits has shape (batch, V), ids (batch, seq).)")


def _repetition_wrong(x: torch.Tensor, ids: torch.Tensor, theta: float) -> list[tuple[torch.Tensor, str]]:
    """The outputs of the typical mistakes on (x, ids, theta), each with its hint."""
    seen = torch.zeros_like(x, dtype=torch.bool).scatter(-1, ids, True)
    seen_anywhere = seen.any(dim=0, keepdim=True).expand_as(seen)
    at_positions = torch.zeros_like(seen)
    at_positions[:, :ids.shape[-1]] = True
    count = torch.zeros_like(x).scatter_add(-1, ids, torch.ones_like(ids, dtype=x.dtype))
    penalised = torch.where(x < 0, x * theta, x / theta)
    return [(torch.where(seen_anywhere, penalised, x),
             "Penalise each row by its own ids: a token that occurs in another row's text is no repetition in this "
             "one (mark the seen tokens along dim 1, row by row)."),
            (torch.where(seen, x / theta, x),
             "You divided every seen logit by theta, negative ones too: a negative logit divided by theta > 1 moves "
             "up towards 0, so the repeated token becomes more probable. Multiply negative logits by theta "
             "(CTRL's paper divides all logits; this sign rule makes it a penalty for every token)."),
            (torch.where(seen, torch.where(x < 0, x / theta, x * theta), x),
             "You multiplied the positive logits and divided the negative ones: that raises the repeated tokens. "
             "Divide positive logits by theta and multiply negative ones by theta."),
            (torch.where(x < 0, x * theta ** count, x / theta ** count),
             "Penalise a token once however often it occurs: you applied theta once per occurrence (theta ** count). "
             "Mark the seen tokens in a boolean mask (scatter True) instead of adding up occurrences."),
            (torch.where(seen, x - theta, x),
             "Divide (positive) or multiply (negative) the logit by theta; do not subtract theta: the penalty is a "
             "factor, not an offset."),
            (torch.where(seen, x - math.log(theta), x),
             "Divide (positive) or multiply (negative) the logit by theta; do not subtract log(theta): the penalty "
             "is a factor on the logit, not an offset."),
            (torch.where(at_positions, penalised, x),
             "ids holds token numbers: penalise logits[b, ids[b, j]] (the logit of the token ids[b, j]), not "
             "logits[b, j] (the position j)."),
            (x, "Nothing changed: the logits of the tokens that occur in ids must be penalised.")]


_REPETITION_LIBRARY = ("RepetitionPenaltyLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor")


def check_repetition_penalty(fn: Callable) -> Verdict:
    """Exercise 8.2 (a repetition penalty; Keskar et al., 2019, CTRL): ``fn(logits, ids, theta)``, for the next
    token's logits of shape ``(batch, V)`` (float32 or float64), the tokens so far ``ids`` of shape ``(batch, seq)``
    (int64) and a penalty ``theta > 1``, returns a new tensor of the same shape and dtype: every token that occurs
    in its row of ``ids`` has its logit divided by ``theta`` when it is positive and multiplied by ``theta`` when
    it is negative (a logit of 0 stays 0), once however often the token occurs; every other logit is unchanged.

    That is transformers' ``RepetitionPenaltyLogitsProcessor(penalty=theta)``, which is refused, with
    ``EncoderRepetitionPenaltyLogitsProcessor``, every function of ``groundup.generation`` and this module's own
    functions (however they are reached)."""

    _library_processors(_REPETITION_LIBRARY)  # imports transformers outside the time bound

    def checks():
        cases = _repetition_cases()
        expected = [_reference_repetition_penalty(x, ids, theta) for x, ids, theta, _ in cases]  # before any tripwire
        shortcuts = _shortcuts(_REPETITION_LIBRARY)
        for (x, ids, theta, what), want in zip(cases, expected):
            call = f"repetition_penalty({what}, theta={theta:g})"
            got = expect_tensor(_call_with_hint(fn, call, (x, ids, theta), ("logits", "ids", "theta"), shortcuts,
                                                _REPETITION_HINT),
                                call, "Return the penalised logits as a torch.Tensor.")
            hint = _REPETITION_HINT
            tolerance = _TOLERANCE.get(x.dtype, _TOLERANCE[torch.float32])
            if got.shape == x.shape and not torch.allclose(got.double(), want.double(), **tolerance):
                for wrong, text in _repetition_wrong(x, ids, theta):
                    if torch.allclose(got.double(), wrong.double(), **tolerance):
                        hint = text
                        break
            _expect_same_dtype(got, x.dtype, call)
            expect_close(got, want, call, hint, **tolerance)

    return run_checks("Exercise 8.2 (a repetition penalty)", checks,
                      "Positive logits are divided by theta, negative ones multiplied: either way a token already "
                      "in the text becomes less probable, once, however often it occurred.")


# ---- Exercise 8.3 ------------------------------------------------------------------------------------------


def _reference_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The book's ``groundup.generation.top_p_filter`` (called before any tripwire is set)."""
    return generation.top_p_filter(logits, p)


def _hugging_face_style(x: torch.Tensor, p: float, tolerance: float) -> torch.Tensor:
    """The mask of kept tokens of an ascending-order top-p (as in Hugging Face's ``TopPLogitsWarper``): remove the
    least probable tokens while their total is <= 1 - p (+ ``tolerance``); the most probable token stays."""
    sorted_logits, order = torch.sort(x, dim=-1)
    remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - p + tolerance
    remove[..., -1] = False
    return ~remove.scatter(-1, order, remove)


def _top_p_hint(kept: torch.Tensor, want: torch.Tensor, x: torch.Tensor, p: float, hint: str, *, seeds: bool,
                shuffled: bool) -> str:
    """The hint for the typical top-p mistakes, read off which tokens the reader kept (``kept``) and should have."""
    n_kept, n_want = kept.sum(-1), want.sum(-1)
    if p <= 1e-3 and not bool(kept.any(-1).all()):
        return "Always keep at least the most probable token, however small p is."
    if bool((n_kept == n_want - 1).all()) and bool((kept <= want).all()):
        if seeds:
            return ("You dropped fruit, the token that crosses p: bananas + cherries = 0.15 is still below 0.18, "
                    "so fruit is needed to reach p. Keep a token when the mass of the tokens before it is < p.")
        return ("You dropped the token whose probability makes the total cross p: keep a token when the mass of "
                "the tokens ranked before it is < p (or shift your 'cumulative mass > p' mask right by one).")
    if bool((n_kept == n_want + 1).all()) and bool((want <= kept).all()):
        ascending = ("" if not torch.equal(kept, _hugging_face_style(x, p, 0.0)) else
                     " In ascending order (as in Hugging Face's TopPLogitsWarper) the same tolerance reads: remove "
                     "the least probable tokens while their total is <= 1 - p + 1e-6.")
        if seeds and p != 0.18:
            return (f"You also kept cake: bananas + cherries + fruit = 0.18 is within 1e-6 of p = {p:.7g}, and the "
                    "exercise counts that as reaching p (floating point cannot tell them apart reliably): keep a "
                    "token only while the mass before it is < p - 1e-6." + ascending)
        if seeds:
            return ("You also kept cake: bananas + cherries + fruit = 0.18 already reaches p = 0.18. In floating "
                    "point that sum can come out as 0.17999999..., so count a total within 1e-6 of p as reaching "
                    "it: keep a token only while the mass before it is < p - 1e-6." + ascending)
        return ("You kept one token too many: stop as soon as the mass reaches p (keep a token only while the "
                "mass of the tokens before it is < p - 1e-6)." + ascending)
    if shuffled and bool((n_kept == n_want).all()):
        return ("You kept three tokens, but not bananas, cherries and fruit: your mask is in sorted order; put it "
                "back in the original order (scatter it with the sort indices).")
    probs = torch.softmax(x.double(), dim=-1)
    if bool(kept.any()) and bool((~kept).any()) and probs[kept].max() < probs[~kept].max():
        return "You kept the least probable tokens: sort in descending order (most probable first)."
    return hint


_TOP_P_LIBRARY = ("TopPLogitsWarper",)


def check_top_p_filter(fn: Callable) -> Verdict:
    """Exercise 8.3 (top-p filter): ``fn(logits, p)`` keeps the smallest set of most probable tokens whose
    probability reaches p (within 1e-6: the seeds' example with p = 0.1800005 keeps bananas, cherries and fruit).
    Ascending-order answers in the style of Hugging Face's ``TopPLogitsWarper`` pass when they use the same
    tolerance. Refused: transformers' ``TopPLogitsWarper``, every function of ``groundup.generation`` (its
    ``top_k_filter`` and ``top_p_filter`` among them) and this module's own functions (however they are reached)."""

    _library_processors(_TOP_P_LIBRARY)  # imports transformers outside the time bound

    def checks():
        probs = torch.tensor([0.1, 0.05, 0.03, 0.02] + [0.01] * 80, dtype=torch.float64)
        seeds = probs.log()  # bananas, cherries, fruit, cake, then 80 other tokens
        order = torch.randperm(84, generator=torch.Generator().manual_seed(3))
        shuffled = seeds[order]  # the same distribution with the tokens in another order
        g = torch.Generator().manual_seed(83)
        rows = torch.randn(4, 12, generator=g, dtype=torch.float64) * 1.5
        cases = [(seeds, 0.18, "the seeds' example (bananas 0.1, cherries 0.05, fruit 0.03, cake 0.02, ...)"),
                 (shuffled, 0.18, "the seeds' example with the tokens shuffled"),
                 (seeds, 0.18 + 5e-7, "the seeds' example"),  # 0.18 is within 1e-6 of p: it reaches p
                 (rows, 0.5, "random logits of shape (4, 12)"), (rows, 0.9, "random logits of shape (4, 12)"),
                 (rows, 1e-3, "random logits of shape (4, 12)"), (rows.float(), 0.7, "float32 logits (4, 12)")]
        expected = [_reference_top_p(x, p) for x, p, _ in cases]  # before any tripwire is set
        shortcuts = _shortcuts(_TOP_P_LIBRARY)

        for (x, p, what), want in zip(cases, expected):
            call = f"top_p_filter({what}, p={p:.7g})"
            hint = ("Sort the probabilities (softmax) in descending order, keep each token while the probability "
                    "of the tokens ranked before it is still below p, and map the mask back to the original order.")
            got = expect_tensor(_call_with_hint(fn, call, (x, p), ("logits", "p"), shortcuts, hint), call,
                                "Return the filtered logits as a torch.Tensor.")
            if got.shape == x.shape:
                hint = _top_p_hint(torch.isfinite(got), torch.isfinite(want), x, p, hint,
                                   seeds=x is seeds, shuffled=x is shuffled)
            _expect_same_dtype(got, x.dtype, call)
            _expect_filtered(got, want, call, hint)

    return run_checks("Exercise 8.3 (top-p filter)", checks,
                      "With p = 0.18 the seeds' bananas, cherries and fruit stay in, and cake is out.")


# ---- Exercise 8.4 ------------------------------------------------------------------------------------------


def _kv_configs() -> list[tuple[str, GPTConfig, int, int, int]]:
    """(how the model is shown, its config, n_tokens, batch_size, bytes_per_number). The first case tells every
    mistake apart: n_heads / n_kv_heads = 3, batch 5, 4 bytes, 30 layers, 8192 tokens."""
    smollm2 = GPTConfig(vocab_size=49152, context_length=8192, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                        d_ff=1536, positional="rope", norm="rmsnorm", activation="swiglu", bias=False,
                        rope_pairing="half", rope_base=100000.0)
    gpt2 = GPTConfig(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12,
                     activation="gelu_tanh")
    made_up = GPTConfig(vocab_size=1000, context_length=512, d_model=320, n_layers=5, n_heads=10, n_kv_heads=2)
    multi_query = GPTConfig(vocab_size=500, context_length=256, d_model=256, n_layers=3, n_heads=8, n_kv_heads=1)
    smollm2_text = "SmolLM2-135M's config (30 layers, 9 query and 3 key/value heads of 64)"
    return [(smollm2_text, smollm2, 8192, 5, 4),
            ("GPT-2 small's config (12 layers, 12 heads of 64, n_kv_heads=None)", gpt2, 1024, 8, 2),
            ("a made-up config (5 layers, 10 query and 2 key/value heads of 32)", made_up, 300, 3, 4),
            ("a made-up config (3 layers, 8 query heads sharing 1 key/value head of 32)", multi_query, 256, 7, 2),
            (smollm2_text, smollm2, 1, 1, 2)]


def _kv_bytes(config: GPTConfig, n_tokens: int, batch_size: int, bytes_per_number: int) -> int:
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    return 2 * config.n_layers * n_kv_heads * config.d_head * n_tokens * batch_size * bytes_per_number


_KV_HINT = ("Read the sizes from the config: config.n_layers, config.d_head, and config.n_kv_heads, which is None in a "
            "model with ordinary multi-head attention (GPT-2): then every query head has its own key/value head, and "
            "n_kv_heads = config.n_heads.")
_KV_BUILD_HINT = ("Compute the size from the config's fields with arithmetic: building a model (or a block, or an "
                  "attention layer) to measure its cache proves nothing, and a real model's would take a while.")


def _kv_hint(got: float, want: int, config: GPTConfig, n_tokens: int, batch_size: int, b: int) -> str:
    """The hint for the typical mistakes, read off the reader's number."""
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    wrong = [(n_kv_heads != config.n_heads, want * config.n_heads / n_kv_heads,
              "With grouped-query attention only the n_kv_heads key/value heads are cached (the query heads share "
              "them): each layer stores n_kv_heads * d_head numbers of keys per token and as many of values, not "
              "n_heads * d_head = d_model."),
             (True, want * config.d_model / config.d_head,
              "Each key/value head has d_head = config.d_head = d_model / n_heads numbers, not d_model: a layer "
              "stores n_kv_heads * d_head numbers of keys per token."),
             (True, want / 2, "You counted only the keys (or only the values): the cache stores both, a factor 2."),
             (batch_size > 1, want / batch_size,
              "Every sequence of the batch has a cache of its own: multiply by batch_size."),
             (b > 1, want / b, "That is the number of numbers: multiply by bytes_per_number for bytes."),
             (True, want / config.n_layers,
              "That is one layer's cache: every layer keeps its own keys and values (times n_layers)."),
             (n_tokens > 1, want / n_tokens, "That is one position's cache: multiply by n_tokens.")]
    for applies, value, hint in wrong:
        if applies and abs(got - value) <= 0.5:
            return hint
    return ("2 (keys and values) * n_layers * n_kv_heads * d_head numbers per position, times n_tokens, "
            "batch_size and bytes_per_number. " + _KV_HINT)


def check_kv_cache_memory_gqa(fn: Callable) -> Verdict:
    """Exercise 8.4 (the KV cache of a real model): ``fn(config, n_tokens, batch_size, bytes_per_number)`` returns
    the bytes of the KV cache of a GPT with grouped-query attention, ``2 * n_layers * n_kv_heads * d_head *
    n_tokens * batch_size * bytes_per_number``, for a :class:`groundup.models.GPTConfig` ``config``
    (``config.n_kv_heads`` is None for ordinary multi-head attention, which means ``n_heads``; ``config.d_head``
    is ``d_model // n_heads``). An int, or a float within 0.5 of it. Refused: the benchmark's
    ``groundup.bench.generation.kv_cache_bytes``, building a model, block or attention layer of the package,
    every function of ``groundup.generation`` and this module's own functions (however they are reached)."""

    def checks():
        cases = _kv_configs()
        expected = [_kv_bytes(config, n, batch, b) for _, config, n, batch, b in cases]  # before any tripwire
        built = [Forbidden(cls, "__init__", label=label) for cls, label in (
            (GPT, "groundup.models.GPT"), (TransformerBlock, "groundup.layers.TransformerBlock"),
            (MultiHeadAttention, "groundup.attention.MultiHeadAttention"))]
        shortcuts = _shortcuts((), *[(item, item.label, _KV_BUILD_HINT) for item in built])
        for (what, config, n, batch, b), want in zip(cases, expected):
            call = f"kv_cache_memory_gqa({what}, n_tokens={n}, batch_size={batch}, bytes_per_number={b})"
            got = expect_number(_call_with_hint(fn, call, (config, n, batch, b),
                                                ("config", "n_tokens", "batch_size", "bytes_per_number"), shortcuts,
                                                _KV_HINT),
                                call, "Return the number of bytes as an int.")
            # every digit (1.88744e+09 would hide them); inf and nan as they are
            shown = f"{got:,.0f}" if math.isfinite(got) and got == round(got) else f"{got:,.2f}"
            expect(abs(got - want) <= 0.5, f"{call} returned {shown}, expected {want:,}",
                   _kv_hint(got, want, config, n, batch, b))

    return run_checks("Exercise 8.4 (the KV cache of a real model)", checks,
                      "SmolLM2-135M caches 2 x 30 x 3 x 64 numbers per token, 22.5 KiB in bfloat16: a third of what "
                      "9 key/value heads would need.")
