"""Checkers for chapter 8 (generation): temperature, top-k and top-p filtering, the KV cache's memory.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), checks the type of what comes back, and
compares at a tolerance that fits the dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from groundup import generation
from groundup.bench.generation import kv_cache_bytes
from groundup.exercises.checking import (
    Mismatch,
    ReaderError,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_integer,
    expect_tensor,
    run_checks,
)

__all__ = ["check_temperature_softmax", "check_top_k_filter", "check_top_p_filter", "check_kv_cache_memory"]

INF = float("-inf")
_TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


_PACKAGE = (generation.top_k_filter, generation.top_p_filter)  # the package's own solutions
_PACKAGE_KV = (kv_cache_bytes,)  # the benchmark's KV cache size: the package's answer to Exercise 8.4


def _call(fn: Callable, call: str, *args, input_name: str = "logits", forbid: tuple = _PACKAGE):
    """``fn(*args)`` through :func:`call_reader` (copies of the inputs, a time bound, the package's solutions in
    ``forbid`` refused); a :class:`Mismatch` if ``fn`` modified its input in place."""
    names = (input_name,) + tuple(f"argument {i + 2}" for i in range(len(args) - 1))
    return call_reader(fn, *args, call=call, names=names, forbid=forbid)


def _call_or_hint(fn: Callable, call: str, *args, hint: str):
    """Like :func:`_call`, but a crash of the reader's function is reported with ``hint``."""
    try:
        return _call(fn, call, *args)
    except ReaderError as err:
        raise ReaderError(err.call, err.error, hint) from None


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


# ---- Exercise 8.1 ------------------------------------------------------------------------------------------


def check_temperature_softmax(fn: Callable) -> Verdict:
    """Exercise 8.1: ``fn(logits, temperature)`` returns ``softmax(logits / temperature)`` over the last dimension."""

    def checks():
        g = torch.Generator().manual_seed(8)
        logits = torch.randn(3, 7, generator=g, dtype=torch.float64) * 2
        huge = torch.tensor([[1000.0, 999.0, 0.0]], dtype=torch.float64)
        cases = [(logits, t) for t in (1.0, 0.5, 2.0)]
        expected = [torch.softmax(x / t, dim=-1) for x, t in cases]
        expected_huge = torch.softmax(huge / 0.5, dim=-1)
        logits32 = logits.float()
        expected32 = torch.softmax(logits32 / 0.7, dim=-1)

        for (x, t), want in zip(cases, expected):
            call = f"temperature_softmax(logits of shape {tuple(x.shape)}, {t})"
            got = expect_tensor(_call(fn, call, x, t), call, "Return a torch.Tensor of probabilities.")
            _expect_same_dtype(got, x.dtype, call)
            hint = "Divide the logits by the temperature, then take the softmax over the last dimension (dim=-1)."
            if got.shape == want.shape:
                if torch.allclose(got, x / t, atol=1e-9) or not torch.allclose(got.sum(-1), torch.ones(3,
                                                                                                     dtype=x.dtype)):
                    hint = ("Each row of probabilities must sum to 1: apply the softmax to the scaled logits "
                            "(you returned something else, e.g. the scaled logits themselves).")
                if t != 1.0 and torch.allclose(got, torch.softmax(x * t, dim=-1), atol=1e-9):
                    hint = ("You multiplied by the temperature: divide instead, so that T < 1 sharpens the "
                            "distribution and T > 1 flattens it (equation 8.3).")
                if torch.allclose(got, torch.softmax(x / t, dim=0), atol=1e-9):
                    hint = "Take the softmax over the vocabulary, the last dimension (dim=-1), not dim=0."
            expect_close(got, want, call, hint, **_TOLERANCE[torch.float64])

        call = "temperature_softmax([[1000, 999, 0]], 0.5)"
        got = expect_tensor(_call(fn, call, huge, 0.5), call)
        expect(bool(torch.isfinite(got).all()), f"{call} returned {got.tolist()} (inf or nan)",
               "exp(2000) overflows: subtract the largest logit first (the softmax does not change when the same "
               "number is subtracted from every logit), or use torch.softmax.")
        expect_close(got, expected_huge, call, "softmax(logits / T) with the largest logit subtracted first.",
                     **_TOLERANCE[torch.float64])

        call = "temperature_softmax(float32 logits, 0.7)"
        got = expect_tensor(_call(fn, call, logits32, 0.7), call)
        _expect_same_dtype(got, torch.float32, call)
        expect_close(got, expected32, call, "softmax(logits / temperature, dim=-1).", **_TOLERANCE[torch.float32])

    return run_checks("Exercise 8.1 (temperature)", checks,
                      "T < 1 sharpens the distribution, T > 1 flattens it, and large logits do not overflow.")


# ---- Exercise 8.2 ------------------------------------------------------------------------------------------


def _reference_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, INF)


def check_top_k_filter(fn: Callable) -> Verdict:
    """Exercise 8.2: ``fn(logits, k)`` keeps the logits ``>=`` the k-th largest of each row, the rest -inf."""

    def checks():
        g = torch.Generator().manual_seed(82)
        rows = torch.randn(3, 9, generator=g, dtype=torch.float64)
        rows[1] += 10.0  # rows on different scales: filtering over the whole tensor keeps only row 1
        ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]], dtype=torch.float64)
        small = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float32)
        cases = [(rows, 3, "random logits of shape (3, 9)"), (rows, 1, "random logits of shape (3, 9)"),
                 (ties, 2, "[[1, 3, 3, 2, 3, 0]]"), (small, 5, "[[0.5, -1, 2]]")]
        expected = [_reference_top_k(x, k) for x, k, _ in cases]

        for (x, k, what), want in zip(cases, expected):
            call = f"top_k_filter({what}, k={k})"
            hint = ("Find the k-th largest logit of each row (torch.topk(logits, k, dim=-1).values[..., -1:]) and "
                    "set every logit below it to -inf.")
            if k > x.shape[-1]:
                hint = "k can exceed the vocabulary size: then keep everything (use min(k, logits.shape[-1]))."
            got = expect_tensor(_call_or_hint(fn, call, x, k, hint=hint), call,
                                "Return the filtered logits as a torch.Tensor.")
            if got.shape == x.shape:
                kth = torch.topk(x, min(k, x.shape[-1]), dim=-1).values[..., -1:]
                if k > 1 and torch.equal(torch.isneginf(got), x <= kth):
                    hint = ("Your comparison also removes the k-th largest logit itself: keep logits >= the k-th "
                            "largest (remove those strictly below it).")
                elif x is ties and int(torch.isfinite(got).sum()) == k:
                    hint = ("Tokens tied with the k-th largest logit must all be kept (here three logits equal 3): "
                            "compare with the k-th largest value instead of keeping exactly k indices.")
                elif x.shape[0] > 1 and torch.equal(torch.isneginf(got), x < torch.topk(x.flatten(), k).values[-1]):
                    hint = "Filter each row (each distribution) separately: take the top k along dim=-1."
            _expect_same_dtype(got, x.dtype, call)
            _expect_filtered(got, want, call, hint)

    return run_checks("Exercise 8.2 (top-k filter)", checks,
                      "Each row keeps its k largest logits (ties with the k-th included); the rest get probability 0.")


# ---- Exercise 8.3 ------------------------------------------------------------------------------------------


def _reference_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    from groundup.generation import top_p_filter

    return top_p_filter(logits, p)


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


def check_top_p_filter(fn: Callable) -> Verdict:
    """Exercise 8.3: ``fn(logits, p)`` keeps the smallest set of most probable tokens whose probability reaches p
    (within 1e-6: the seeds' example with p = 0.1800005 keeps bananas, cherries and fruit). Ascending-order
    answers in the style of Hugging Face's ``TopPLogitsWarper`` pass when they use the same tolerance."""

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
        expected = [_reference_top_p(x, p) for x, p, _ in cases]

        for (x, p, what), want in zip(cases, expected):
            call = f"top_p_filter({what}, p={p:.7g})"
            hint = ("Sort the probabilities (softmax) in descending order, keep each token while the probability "
                    "of the tokens ranked before it is still below p, and map the mask back to the original order.")
            got = expect_tensor(_call_or_hint(fn, call, x, p, hint=hint), call,
                                "Return the filtered logits as a torch.Tensor.")
            if got.shape == x.shape:
                hint = _top_p_hint(torch.isfinite(got), torch.isfinite(want), x, p, hint,
                                   seeds=x is seeds, shuffled=x is shuffled)
            _expect_same_dtype(got, x.dtype, call)
            _expect_filtered(got, want, call, hint)

    return run_checks("Exercise 8.3 (top-p filter)", checks,
                      "With p = 0.18 the seeds' bananas, cherries and fruit stay in, and cake is out.")


# ---- Exercise 8.4 ------------------------------------------------------------------------------------------


def check_kv_cache_memory(fn: Callable) -> Verdict:
    """Exercise 8.4: ``fn(n_layers, n_heads, d_head, n_tokens, bytes_per_number)`` is the KV cache's size in bytes
    (an int); the benchmark's ``groundup.bench.generation.kv_cache_bytes`` is refused."""

    def expected(n_layers, n_heads, d_head, n_tokens, b):
        return 2 * n_layers * n_heads * d_head * n_tokens * b

    def checks():
        # the benchmark's model, the chapter's model, GPT-2 small in float16, a LLaMA-like 32-layer model
        for args in [(6, 6, 64, 256, 4), (4, 4, 32, 256, 4), (12, 12, 64, 1024, 2), (32, 32, 128, 4096, 2)]:
            call = f"kv_cache_memory{args}"
            want = expected(*args)
            got = expect_integer(_call(fn, call, *args, input_name="n_layers", forbid=_PACKAGE_KV), call,
                                 "Return the number of bytes as an int (a whole number: use * and //, not /).")
            hint = "Per token and per layer the cache holds a key and a value vector for each head."
            if got == want // 2:
                hint = "You counted only the keys (or only the values): the cache stores both, a factor 2."
            elif got == want // args[0]:
                hint = "That is one layer's cache: every layer keeps its own keys and values (times n_layers)."
            elif got == want // args[4]:
                hint = "That is the number of numbers: multiply by bytes_per_number for bytes."
            expect_close(got, want, call, hint, rtol=0, atol=0.5)

    return run_checks("Exercise 8.4 (KV cache memory)", checks,
                      "2 · n_L · n_H · d_h · bytes per token: GPT-2 small needs 36 KiB per token in float16.")
