"""Checkers for chapter 11 (scaling out): a ring all-reduce simulated by hand, and the memory of ZeRO / FSDP.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from groundup.distributed import training_memory
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

__all__ = ["check_ring_allreduce", "check_zero_memory"]


# ---- Exercise 11.1 -----------------------------------------------------------------------------------------

_BIG = 2.0 ** 60  # 1 + 2^60 rounds to 2^60 in float64: the order of the additions shows in the result


def _order_revealing_tensors(p: int = 3) -> list[torch.Tensor]:
    """p tensors of p chunks of p numbers: element j of every chunk is 1 at process j and +-2^60 at the others, so
    a chunk added up in any order ends as the one-hot vector of the process added last (2^60 - 2^60 + 1 = 1, but
    2^60 + 1 - 2^60 = 0)."""
    tensors = [torch.empty(p * p, dtype=torch.float64) for _ in range(p)]
    for j in range(p):
        others = [q for q in range(p) if q != j]
        for r in range(p):
            value = 1.0 if r == j else (_BIG if r == others[0] else -_BIG)
            for c in range(p):
                tensors[r][c * p + j] = value
    return tensors


def _last_added(chunk: torch.Tensor) -> int | None:
    """The process added last into ``chunk`` of the order-revealing sum, or ``None`` if no order gives it."""
    if not bool(((chunk == 0) | (chunk == 1)).all()) or int(chunk.sum()) != 1:
        return None
    return int(chunk.argmax())


def _expect_a_ring(fn: Callable) -> None:
    """In a ring each chunk's partial sum starts at another process, so the p chunks are added up in p different
    orders; a sum computed in one place (``sum(tensors)``) adds every chunk in the same order."""
    p = 3
    tensors = _order_revealing_tensors(p)
    call = f"my_ring_allreduce(tensors) with p = {p} tensors of 1 and ±2^60"
    out = call_reader(fn, tensors, call=call, names=("tensors",))
    expect(isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)) and len(out[0]) == p,
           f"{call} returned {type(out).__name__}", "Return a pair: (the list of p results, the list of counts).")
    results = [expect_tensor(t, f"{call}: results[{r}]") for r, t in enumerate(out[0])]
    expect(all(t.shape == (p * p,) and torch.equal(t, results[0]) for t in results),
           f"{call}: the processes end with different results",
           "After the all-gather every process holds the same reduced chunks: copy them, do not add them again.")
    last = [_last_added(results[0][c * p:(c + 1) * p].double()) for c in range(p)]
    expect(None not in last, f"{call}: the results are not these numbers added up in any order",
           "Add the chunks in float64 as they are (no rescaling, no other dtype).")
    expect(sorted(last) == list(range(p)),
           f"{call}: every chunk was added up in the same order (process {last[0]} last), as when the sum is "
           "computed in one place",
           "In a ring each chunk's partial sum starts at a different process and travels round it, so the "
           "chunks are added up in different orders. Pass one chunk from process r to (r + 1) mod p per step, "
           "as the exercise describes, instead of summing the tensors at once (sum(tensors)).")


def check_ring_allreduce(fn: Callable) -> Verdict:
    """Exercise 11.1: ``fn(tensors) -> (results, sent)``: a ring all-reduce (sum) of p equal-length 1-D tensors,
    simulated in one process; ``sent[r]`` counts the numbers process r sent, which must be 2 (p − 1)/p · N. A
    last case shows whether the chunks really went round a ring (see :func:`_expect_a_ring`)."""

    def checks():
        g = torch.Generator().manual_seed(11)
        for p, n in ((2, 6), (3, 9), (4, 8), (1, 5)):
            tensors = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(p)]
            expected = torch.stack(tensors).sum(0)
            call = f"my_ring_allreduce(tensors) with p = {p} tensors of N = {n} numbers"
            out = call_reader(fn, tensors, call=call, names=("tensors",))
            expect(isinstance(out, tuple) and len(out) == 2, f"{call} returned a {type(out).__name__}",
                   "Return a pair: (the list of p results, the list of p counts of numbers sent).")
            results, sent = out
            expect(isinstance(results, (list, tuple)) and len(results) == p,
                   f"{call}: the results are not a list of {p} tensors", "Return one result per process.")
            for r, t in enumerate(results):
                t = expect_tensor(t, f"{call}: results[{r}]")
                hint = "Every process must end with the sum of all p tensors (all-reduce with op SUM)."
                if t.shape == expected.shape and torch.allclose(t, expected / p):
                    hint = "That is the average; all_reduce sums (DDP divides by p afterwards)."
                expect_close(t, expected, f"{call}: results[{r}]", hint, rtol=1e-12, atol=1e-12)
            expect(isinstance(sent, (list, tuple)) and len(sent) == p,
                   f"{call}: the counts are not a list of {p} numbers", "Return how many numbers each process sent.")
            want = 2 * (p - 1) * (n // p)
            for r, s in enumerate(sent):
                got = expect_number(s, f"{call}: sent[{r}]")
                if not math.isclose(got, want):
                    raise Mismatch(f"{call}: process {r} sent {got:g} numbers, expected 2 (p − 1) N / p = {want}",
                                   "In each of the p − 1 reduce-scatter steps and each of the p − 1 all-gather "
                                   "steps a process sends one chunk of N / p numbers to its right-hand neighbour, "
                                   "never the whole tensor.")
        _expect_a_ring(fn)

    return run_checks("Exercise 11.1 (ring all-reduce)", checks,
                      "Every process ends with the sum, and each sent 2 (p − 1) N / p numbers, for p = 1 to 4.")


# ---- Exercise 11.2 -----------------------------------------------------------------------------------------


def check_zero_memory(fn: Callable) -> Verdict:
    """Exercise 11.2: ``fn(n_params, n_gpus, stage) -> bytes per GPU`` for mixed-precision Adam with ZeRO."""

    def checks():
        cases = [(124_000_000, 1, 0), (124_000_000, 8, 0), (7_000_000_000, 8, 1), (7_000_000_000, 8, 2),
                 (7_000_000_000, 8, 3), (7_000_000_000, 64, 3), (1_000, 4, 2)]
        for n, gpus, stage in cases:
            expected = training_memory(n, gpus, stage)["total"]
            call = f"my_zero_memory({n:_}, n_gpus={gpus}, stage={stage})"
            got = expect_number(call_reader(fn, n, gpus, stage, call=call, forbid=(training_memory,)), call,
                                "Return the number of bytes.")
            hints = {16 * n: "With several GPUs and stage >= 1 some parts are divided by n_gpus.",
                     16 * n / gpus: "Only stage 3 divides everything: stage 1 shards the optimizer state (12 bytes), "
                                    "stage 2 also the gradients (2 bytes); the rest stays whole on every GPU."}
            hint = hints.get(got, "Mixed-precision Adam: 2 bytes of weights + 2 of gradients + 12 of optimizer "
                                  "state (fp32 copy, m, v) per parameter; stage 1 divides the 12 by n_gpus, stage 2 "
                                  "also the gradients' 2, stage 3 also the weights' 2.") if stage or gpus > 1 else (
                "Stage 0 (plain DDP) keeps all 16 bytes per parameter on every GPU.")
            expect_close(got, expected, call, hint, rtol=1e-9, atol=0.5)

    return run_checks("Exercise 11.2 (memory per GPU with ZeRO)", checks,
                      "It matches groundup.distributed.training_memory for stages 0 to 3.")
